"""What one compiled pipeline-stage forward call of a DeepSeek-V3 dense MLA layer keeps for its
backward, output by output (shape, dtype, bytes and the op that made it), beside ``lmfunc.plan``'s
per-layer terms.

Workload: DeepSeek-V3's attention and dense MLP (h 7168, 128 heads, query latent 1536, key/value
latent 512, heads 128 + 64 RoPE, values 128, FFN 18432), ``--layers`` layers (default 2) over pp 2,
bf16, one sequence of ``--seq`` (default 4096) tokens per microbatch, no MoE and no MTP; the first
pipeline rank is traced on fake tensors (``lmfunc.dryrun.pipeline``), nothing is allocated.

``python -m experiments.probes.mla_kept [--seq 4096] [--layers 2] [--recompute none|selective]
[--dp-shard 128 --ep 64]`` (DeepSeek-V3's layout: its dense leaves FSDP over dp_shard and ep)
"""

from __future__ import annotations

import argparse
import collections

import torch

from lmfunc.config.command_line import parse_config
from lmfunc.dryrun import pipeline as dry_pipeline
from lmfunc.plan.memory import layer_kept_bytes

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--dp-shard", type=int, default=1, help="data-parallel shard ranks (FSDP) per stage")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks carved out of them (DeepSeek-V3's experts, every layer dense)")
    args = parser.parse_args()
    words = ["--model.vocab-size", "1024", "--model.hidden-size", "7168", "--model.num-layers", str(args.layers),
             "--model.num-attention-heads", "128", "--model.ffn-hidden-size", "18432",
             "--model.max-position-embeddings", str(args.seq), "--model.no-tie-embeddings",
             "--model.multi-latent-attention", "--model.q-lora-rank", "1536", "--model.kv-lora-rank", "512",
             "--model.qk-head-dim", "128", "--model.qk-pos-emb-head-dim", "64", "--model.v-head-dim", "128",
             "--model.recompute-granularity", args.recompute,
             "--data.seq-length", str(args.seq), "--precision.compute-dtype", "bf16",
             "--run.micro-batch-size", "1", "--parallel.pp", "2", "--parallel.dp-shard", str(args.dp_shard),
             "--parallel.ep", str(args.ep), "--run.global-batch-size", str(2 * args.dp_shard)]
    if args.ep > 1:
        words += ["--model.num-experts", "256", "--model.moe-ffn-hidden-size", "2048",
                  "--model.moe-layer-freq", *["0"] * args.layers]
    world = 2 * args.dp_shard
    cfg, _ = parse_config(words, "x", "x")
    cfg = cfg.validate(world)
    details: dict[int, list] = {}
    original = dry_pipeline.StepRecorder.runner

    def runner(self, index, graph):
        run = original(self, index, graph)
        makers = dry_pipeline._output_makers(graph)

        def listed(inputs):
            outputs = run(inputs)
            if index not in details:
                details[index] = [(maker, tuple(o.shape), o.dtype, o.untyped_storage().nbytes())
                                  for maker, o in zip(makers, outputs) if isinstance(o, torch.Tensor)]
            return outputs

        listed._boxed_call = True
        return listed

    dry_pipeline.StepRecorder.runner = runner
    dry_pipeline.trace_pipeline_rank(cfg, world, 0)
    forward = details[0]
    seen, total = collections.Counter(), 0
    print(f"graph 0 (first stage forward, {args.layers // 2} layer(s)): {len(forward)} outputs")
    for maker, shape, dtype, nbytes in sorted(forward, key=lambda item: -item[3]):
        if nbytes >= MiB:
            print(f"  {nbytes / MiB:10.2f} MiB  {maker:32s} {str(shape):28s} {dtype}")
        seen[maker] += nbytes
        total += nbytes
    print(f"  total {total / MiB:.2f} MiB; by maker: " + ", ".join(f"{m} {b / MiB:.1f}" for m, b in seen.most_common(8)))
    print(f"plan: one layer keeps {layer_kept_bytes(cfg, 1, args.recompute) / MiB:.2f} MiB per microbatch")


if __name__ == "__main__":
    main()
