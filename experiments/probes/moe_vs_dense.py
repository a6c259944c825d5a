"""Probe: the MoE train step against a dense one with the same active parameters, and dropless
against capacity, timed in turn in one process (``experiments.bench.paired.time_in_turn``).

Workload: ``moe-small``'s shape (h 256, 4 layers, GQA 4/2, QK-norm, 8 experts of width 256,
top-2) against the same model with a dense SwiGLU MLP of width 2 x 256 = 512 (the active expert
width per token), one microbatch of ``--batch`` sequences of ``--seq`` tokens, fp32, AdamW.
Variants: dense, MoE dropless, MoE with capacity factor 1.0 and 1.25. Reported per variant: the
median step time, its per-round ratio to the dense step, tokens/s, and MFU with Megatron's FLOPs
(active parameters) against the measured fp32 matmul peak on the CPU, or the GPU's datasheet
peak in the compute dtype's math (``lmfunc.metrics.peak_flops``) on cuda.

    python -m experiments.probes.moe_vs_dense [--compile] [--rounds 12] [--threads 1]
    python -m experiments.probes.moe_vs_dense --device cuda --dtype bf16 --compile \
        --hidden 1024 --experts 16 --expert-ffn 1024 --batch 16 --seq 1024     # a GPU-sized shape

The size flags replace ``moe-small``'s hidden size (heads of 64), expert count and expert width;
the dense variant's MLP stays ``top-k x expert width`` wide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional

import torch

from experiments.bench.paired import paired_summary, time_in_turn
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.metrics import peak_flops
from lmfunc.optim import adamw
from lmfunc.plan.megatron import flops_per_token
from lmfunc.train.state import TrainState
from lmfunc.train.step import make_train_step


def variants(hidden: Optional[int] = None, experts: Optional[int] = None, expert_ffn: Optional[int] = None,
             seq: int = 256) -> dict:
    """The four configs, from ``moe-small`` with the given sizes replaced."""
    moe = model_preset("moe-small")
    sizes = {"max_position_embeddings": max(seq, moe.max_position_embeddings)}
    if hidden is not None:
        heads = max(hidden // 64, 1)
        sizes.update(hidden_size=hidden, num_attention_heads=heads, num_query_groups=max(heads // 2, 1))
    if experts is not None:
        sizes["num_experts"] = experts
    if expert_ffn is not None:
        sizes["moe_ffn_hidden_size"] = expert_ffn
    moe = dataclasses.replace(moe, **sizes)
    dense = dataclasses.replace(moe, num_experts=None, ffn_hidden_size=moe.moe_router_topk * moe.expert_ffn_size)
    return {
        "dense": dense,
        "moe dropless": moe,
        "moe capacity 1.0": dataclasses.replace(moe, moe_expert_capacity_factor=1.0),
        "moe capacity 1.25": dataclasses.replace(moe, moe_expert_capacity_factor=1.25),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (params stay fp32)")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--expert-ffn", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=None, choices=("dense", "dropless", "1.0", "1.25"),
                        help="a subset of the variants (dense always runs, as the reference)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    compute_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    configs = variants(args.hidden, args.experts, args.expert_ffn, args.seq)
    if args.variants is not None:
        configs = {name: cfg for name, cfg in configs.items()
                   if name == "dense" or any(name.endswith(" " + v) for v in args.variants)}
    vocab = configs["dense"].vocab_size
    tokens = torch.randint(0, vocab, (1, args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[..., :-1].contiguous().to(device), "labels": tokens[..., 1:].contiguous().to(device)}
    steps = {}
    for name, cfg in configs.items():
        tx = adamw(1e-4)
        state = [TrainState.create(model.init(cfg, seed=0, device=device), tx)]
        step = make_train_step(cfg, tx, compile=args.compile, compute_dtype=compute_dtype)

        def run(step=step, state=state):
            state[0], metrics = step(state[0], batch)
            return metrics["loss"]

        for _ in range(2):  # compile, warm up
            run()
        steps[name] = run
    times = time_in_turn(steps, args.rounds)
    summary = paired_summary(times, "dense")
    peak, peak_source = peak_flops(device, args.dtype, False, None)
    results = {}
    for name, cfg in configs.items():
        tokens_per_s = args.batch * args.seq / summary[name]["median_s"]
        results[name] = {**summary[name], "tokens_per_s": tokens_per_s,
                         "mfu": tokens_per_s * flops_per_token(cfg, args.seq) / peak,
                         "flops_per_token": flops_per_token(cfg, args.seq)}
        print(f"{name:18s} {summary[name]['median_s'] * 1e3:8.1f} ms  x{summary[name]['ratio_median']:.2f} of dense "
              f"[{summary[name]['ratio_q25']:.2f}, {summary[name]['ratio_q75']:.2f}]  {tokens_per_s:8.0f} tok/s  "
              f"MFU {100 * results[name]['mfu']:.1f}%")
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({peak_source}), {args.dtype} compute on {device}, "
          f"{args.threads} thread(s), {'compiled' if args.compile else 'eager'}, {args.rounds} rounds, "
          f"{args.batch} x {args.seq} tokens per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
