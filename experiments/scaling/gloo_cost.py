"""What the bucketed FSDP collectives of one step cost on their own, with gloo, on this box.

Run under ``torchrun --nproc-per-node 2`` (one thread per rank, nothing else running):
``python -m torch.distributed.run --standalone --nproc-per-node 2 -m experiments.scaling.gloo_cost CONFIG.yaml OUT.json``.
For each region of the config's model (embed, each block, head)
it times, on rank 0, the all-gather of the region's fp32 parameter shards and the reduction of its
fp32 gradients to their shards as lmfunc issues it on gloo (an all-to-all and a sum over the
ranks, ``lmfunc.compiler.collective_buckets``) and as c10d's own reduce-scatter (an all-reduce of
the whole tensor on gloo), each back to back with no compute, and writes the medians and their
per-step sums: the CPU time gloo needs for one step's FSDP communication when no core is free to
hide it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from lmfunc.config.yaml_io import load_config
from lmfunc.model import gpt
from lmfunc.tree import flatten_with_paths
from lmfunc.train.__main__ import exit_without_finalizing

REPEATS = 20


def region_numels(cfg) -> dict[str, int]:
    """Parameter elements per region (``embed``, ``layers.<i>``, ``head``) as the model marks them:
    the tied embedding is gathered in ``embed``, the final norm (and an untied output) in ``head``."""
    numels: dict[str, int] = defaultdict(int)
    for path, leaf in flatten_with_paths(gpt.param_shapes(cfg)):
        top = path.split(".")[0]
        name = "embed" if top == "embed" else (".".join(path.split(".")[:2]) if top == "layers" else "head")
        numels[name] += math.prod(leaf.shape)
    return dict(numels)


def _median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main(config: str, out: str) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = {}
    for name, numel in region_numels(load_config(config).model).items():
        numel -= numel % world
        full, shard = torch.randn(numel), torch.empty(numel // world)
        gathered, received = torch.empty(numel), torch.empty(numel)

        def all_to_all_and_sum():
            dist.all_to_all_single(received, full)
            return received.view(world, -1).sum(0)

        rows[name] = {
            "mib": numel * 4 / 2**20,
            "all_gather_ms": _median_ms(lambda: dist.all_gather_into_tensor(gathered, shard)),
            "all_to_all_sum_ms": _median_ms(all_to_all_and_sum),
            "c10d_reduce_scatter_ms": _median_ms(lambda: dist.reduce_scatter_tensor(shard, full)),
        }
    if dist.get_rank() == 0:
        total = {k: sum(r[k] for r in rows.values()) for k in next(iter(rows.values()))}
        with open(out, "w") as f:
            json.dump({"regions": rows, "step": total, "world": world}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_without_finalizing()  # gloo's threads can abort a finalizing interpreter (see there)
