"""``torchrun --nproc-per-node 2 tests/save_failure_worker.py OUT_DIR WHERE``: the training command on
dp_shard=2 (checkpoint.on_save_error stop) where only rank 0's part of the step-2 checkpoint save
fails, for ``tests/test_faults.py``. WHERE is ``prepare`` (rank 0 cannot make the save's folder: a
full disk) or ``commit`` (rank 0 cannot rename the written save into place, which it finds in the
background, at its own step)."""

import errno
import os
import sys

import torch.distributed as dist

from lmfunc.train.__main__ import main

out_dir, where = sys.argv[1], sys.argv[2]
failing = "iter_0000002.tmp" if where == "prepare" else "iter_0000002"
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
main(["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32", "--parallel.dp-shard", "2",
      "--run.micro-batch-size", "2", "--run.train-iters", "6", "--optim.lr-warmup-iters", "1", "--run.eval-iters", "0",
      "--run.sample-tokens", "0", "--run.no-compile", "--log.log-interval", "1", "--log.no-progress-bar",
      "--checkpoint.save-interval", "2", "--checkpoint.on-save-error", "stop", "--run.out-dir", out_dir,
      "--run.name", "r"])
