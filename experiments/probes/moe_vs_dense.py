"""Probe: the MoE train step against a dense one with the same active parameters, and dropless
against capacity, timed in turn in one process (``experiments.bench.paired.time_in_turn``).

Workload: ``moe-small``'s shape (h 256, 4 layers, GQA 4/2, QK-norm, 8 experts of width 256,
top-2) against the same model with a dense SwiGLU MLP of width 2 x 256 = 512 (the active expert
width per token), one microbatch of ``--batch`` sequences of ``--seq`` tokens, fp32, AdamW.
Variants: dense, MoE dropless, MoE with capacity factor 1.0 and 1.25. Reported per variant: the
median step time, its per-round ratio to the dense step, tokens/s, and MFU with Megatron's FLOPs
(active parameters) against the measured fp32 matmul peak.

    python -m experiments.probes.moe_vs_dense [--compile] [--rounds 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from experiments.bench.paired import paired_summary, time_in_turn
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.metrics import measure_matmul_peak_flops
from lmfunc.optim import adamw
from lmfunc.plan.megatron import flops_per_token
from lmfunc.train.state import TrainState
from lmfunc.train.step import make_train_step


def variants() -> dict:
    moe = model_preset("moe-small")
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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, 384, (1, args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[..., :-1].contiguous(), "labels": tokens[..., 1:].contiguous()}
    steps, configs = {}, variants()
    for name, cfg in configs.items():
        tx = adamw(1e-4)
        state = [TrainState.create(model.init(cfg, seed=0), tx)]
        step = make_train_step(cfg, tx, compile=args.compile)

        def run(step=step, state=state):
            state[0], metrics = step(state[0], batch)
            return metrics["loss"]

        for _ in range(2):  # compile, warm up
            run()
        steps[name] = run
    times = time_in_turn(steps, args.rounds)
    summary = paired_summary(times, "dense")
    peak = measure_matmul_peak_flops()
    results = {}
    for name, cfg in configs.items():
        tokens_per_s = args.batch * args.seq / summary[name]["median_s"]
        results[name] = {**summary[name], "tokens_per_s": tokens_per_s,
                         "mfu": tokens_per_s * flops_per_token(cfg, args.seq) / peak,
                         "flops_per_token": flops_per_token(cfg, args.seq)}
        print(f"{name:18s} {summary[name]['median_s'] * 1e3:8.1f} ms  x{summary[name]['ratio_median']:.2f} of dense "
              f"[{summary[name]['ratio_q25']:.2f}, {summary[name]['ratio_q75']:.2f}]  {tokens_per_s:8.0f} tok/s  "
              f"MFU {100 * results[name]['mfu']:.1f}%")
    print(f"peak {peak / 1e9:.1f} GFLOP/s (measured fp32 matmul), {args.threads} thread(s), "
          f"{'compiled' if args.compile else 'eager'}, {args.rounds} rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
