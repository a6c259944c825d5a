"""Stopping a run cleanly: SIGTERM/SIGINT and time limits, agreed on by every rank.

A handler only records that a signal arrived. After each step the loop asks ``should_stop``: the
local wish (a failed checkpoint save, a signal, or the time limit) is all-reduced with MAX over the
ranks (Megatron's ``DistributedSignalHandler``), so when any rank is told to stop, all of them stop
after the same step, save one consistent checkpoint (none after a failed save) and exit.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Installs SIGTERM/SIGINT handlers (``install=True``, main thread only) until ``close``. The
    first signal asks for a clean stop; a second one raises ``KeyboardInterrupt`` at once.

    ``time_limit_s``: stop once this many seconds have passed since construction.
    ``device``: where the per-step stop flags are all-reduced: the default process group's device
    (cuda under NCCL, which cannot reduce CPU tensors; cpu under gloo). The flags ride the training
    group on purpose: one tiny collective per step, in step order, with no second group to set up.
    """

    def __init__(self, install: bool = True, time_limit_s: Optional[float] = None,
                 device: str | torch.device = "cpu"):
        self.received: Optional[int] = None
        self.device = torch.device(device)
        self.time_limit_s = time_limit_s
        self._started = time.perf_counter()
        self._previous: dict[int, object] = {}
        if install and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # a second signal: the user insists, stop now without a checkpoint
            raise KeyboardInterrupt(f"second {name}: stopped at once, without saving a checkpoint")
        self.received = signum
        sys.stderr.write(f"\n{name} received: stopping after the current step, with a checkpoint (the first step "
                         "includes compiling and can take a minute); press Ctrl-C again to stop now without saving\n")
        sys.stderr.flush()

    def _local_reason(self) -> int:
        """0: go on; 1: a signal arrived; 2: the time limit passed."""
        if self.received is not None:
            return 1
        if self.time_limit_s is not None and time.perf_counter() - self._started > self.time_limit_s:
            return 2
        return 0

    def should_stop(self, save_failed: bool = False) -> Optional[str]:
        """``"save_failed"`` (``save_failed``: this rank's checkpoint save failed and the run's
        policy is to stop), ``"signal"`` or ``"exit_duration_in_mins"`` when any rank wants to stop,
        in that order, else None (a collective on a process group: every rank calls it after every
        step, so a failure only one rank saw stops every rank after the same step)."""
        reason = self._local_reason()
        wishes = [save_failed, reason == 1, reason == 2]
        if dist.is_available() and dist.is_initialized():
            flags = torch.tensor(wishes, dtype=torch.int32, device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            wishes = [bool(flag) for flag in flags.tolist()]
        for wish, name in zip(wishes, ("save_failed", "signal", "exit_duration_in_mins")):
            if wish:
                return name
        return None

    def close(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
