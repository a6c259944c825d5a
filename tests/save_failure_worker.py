"""``torchrun --nproc-per-node 2 tests/save_failure_worker.py OUT_DIR WHERE``: the training command on
dp_shard=2 (checkpoint.on_save_error stop) where only rank 0's part of the step-2 checkpoint save
fails, for ``tests/test_faults.py``. WHERE is ``prepare`` (rank 0 cannot make the save's folder: a
full disk), ``commit`` (rank 0 cannot rename the written save into place, which it finds in the
background, at its own step) or ``late-commit`` (the same, with rank 0's background write slowed by
2 s, so that rank 0 finds the failure only inside the next save, while rank 1 is already in it)."""

import errno
import os
import sys

import torch.distributed as dist

from lmfunc.train.__main__ import main

out_dir, where = sys.argv[1], sys.argv[2]
failing = "iter_0000002.tmp" if where == "prepare" else "iter_0000002"  # commit, late-commit: the rename
real = {"makedirs": os.makedirs, "rename": os.rename}


def fail_on_rank_0(name):
    def call(path, *args, **kwargs):
        target = args[0] if name == "rename" else path
        if dist.is_initialized() and dist.get_rank() == 0 and str(target).endswith(failing):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real[name](path, *args, **kwargs)
    return call


os.makedirs = fail_on_rank_0("makedirs")
os.rename = fail_on_rank_0("rename")
if where == "late-commit":
    import contextlib
    import time

    from torch.distributed.checkpoint.filesystem import FileSystem

    opened = FileSystem.create_stream

    @contextlib.contextmanager
    def slow_on_rank_0(self, path, mode):
        if dist.get_rank() == 0 and "iter_0000002" in str(path):
            time.sleep(2)
        with opened(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = slow_on_rank_0
main(["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32", "--parallel.dp-shard", "2",
      "--run.micro-batch-size", "2", "--run.train-iters", "6", "--optim.lr-warmup-iters", "1", "--run.eval-iters", "0",
      "--run.sample-tokens", "0", "--run.no-compile", "--log.log-interval", "1", "--log.no-progress-bar",
      "--checkpoint.save-interval", "2", "--checkpoint.on-save-error", "stop", "--run.out-dir", out_dir,
      "--run.name", "r"])
