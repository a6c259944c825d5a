"""The PyTorch profiler over a window of training steps (Megatron's ``--profile``,
``--profile-step-start``, ``--profile-step-end``, ``--profile-ranks``).

Each profiled rank writes one Chrome trace, ``RUN_DIR/profile/rank<R>_steps<A>-<B>.json``, with
the host's operators (ATen ops, compiled-graph calls, collectives and their waits) with their
input shapes and dtypes (so a collective's bytes can be read off it) and, on cuda, the device's
kernels. Open it in ``chrome://tracing`` or https://ui.perfetto.dev.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from lmfunc.config.train import LogConfig


class StepProfiler:
    """Profiles steps ``profile_step_start <= step < profile_step_end`` on the ranks in
    ``profile_ranks``; a no-op when ``log.profile`` is off or this rank is not listed."""

    def __init__(self, log: LogConfig, rank: int, run_dir: str, device: torch.device,
                 echo: Callable[[str], None] = print):
        self.active = log.profile and rank in log.profile_ranks
        self.start, self.end = log.profile_step_start, log.profile_step_end
        self.rank, self.run_dir, self.device, self.echo = rank, run_dir, device, echo
        self.last_step: Optional[int] = None
        self._profiler: Optional[profile] = None

    def before_step(self, step: int) -> None:
        """Start the profiler when ``step`` is the window's first step."""
        if self.active and step == self.start and self._profiler is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()

    def after_step(self, step: int) -> None:
        """Stop and write the trace after the window's last step."""
        if self._profiler is not None:
            self.last_step = step
            if step == self.end - 1:
                self.finish()

    def finish(self) -> Optional[str]:
        """Stop and write the trace now (also when the run ended inside the window); returns its
        path, or None when nothing was profiled."""
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        if self.last_step is None:
            return None
        path = os.path.join(self.run_dir, "profile", f"rank{self.rank}_steps{self.start}-{self.last_step}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profiler.export_chrome_trace(path)
        self.echo(f"profile of steps {self.start}-{self.last_step} written to {path}")
        return path
