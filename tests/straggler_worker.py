"""``torchrun --nproc-per-node 2 tests/straggler_worker.py OUT_DIR``: the training command on
dp_shard=2 with rank 1's batch loading slowed down by 1.2 s per batch (longer than a step) (a straggler in the data
phase), for ``tests/test_timers.py``."""

import sys
import time

import torch.distributed as dist

from lmfunc.train import loop
from lmfunc.train.__main__ import main

slow_rank, original = 1, loop.global_batch_part


def slow_global_batch_part(*args, **kwargs):
    if dist.get_rank() == slow_rank:
        time.sleep(1.2)
    return original(*args, **kwargs)


loop.global_batch_part = slow_global_batch_part
main(["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32", "--parallel.dp-shard", "2",
      "--run.micro-batch-size", "2", "--run.train-iters", "8", "--optim.lr-warmup-iters", "1", "--run.eval-iters", "0",
      "--run.sample-tokens", "0", "--run.no-compile", "--log.log-interval", "4", "--log.no-progress-bar",
      "--checkpoint.no-save", "--run.out-dir", sys.argv[1], "--run.name", "straggler"])
