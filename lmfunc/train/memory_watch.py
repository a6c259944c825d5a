"""The plan's predicted step memory next to the measured peak, at the first step and at the end.

On cuda the measurement is the caching allocator's peak (``torch.cuda.max_memory_allocated``,
tensors and cuBLAS's workspace, directly comparable with the prediction; ``reserved`` also counts
cached blocks). The first step's peak includes compiling it (about 65 MiB above the steady step of
the default job on an H200; Inductor also benchmarks kernel configurations on that first call),
so the peak counter restarts after that report, and the end report is the peak of the steps after it. On
the CPU it is the process's peak RSS, which also holds the Python runtime, torch's libraries and
the compiler's working memory; the RSS measured before the model was built is logged beside it,
so ``baseline + predicted`` is the figure to compare. The plan predicts the compiled step; an
eager step (``--run.no-compile``) keeps every autograd intermediate, so its report says that the
prediction is not its own.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmfunc.metrics import memory_stats_mib
from lmfunc.plan.report import Plan
from lmfunc.train.log import RunLogger

MiB = 2**20


class MemoryWatch:
    """Created before the model is built (the CPU baseline RSS is read then)."""

    def __init__(self, plan: Plan, device: torch.device, compiled: bool = True) -> None:
        self.device = device
        self.compiled = compiled
        self.predicted_mib: Optional[float] = plan.lmfunc.peak / MiB if plan.lmfunc is not None else None
        self.baseline_rss_mib = memory_stats_mib().get("rss")

    def report(self, logger: RunLogger, step: int, when: str) -> dict[str, float]:
        """Echo and record (kind ``memory``) the measured peaks next to the prediction; ``when`` names
        the moment ('first step' or 'end'). Returns the record's numbers."""
        stats = {f"{key}_mib": round(value, 1) for key, value in memory_stats_mib(self.device).items()}
        values: dict[str, float] = dict(stats)
        if self.predicted_mib is not None:
            values["predicted_step_peak_mib"] = round(self.predicted_mib, 1)
        if self.device.type == "cuda":
            since = "compiling included" if when == "first step" else "since the first step"
            measured = (f"CUDA allocator peak ({since}) {stats['cuda_peak_allocated_mib']:,.1f} MiB allocated, "
                        f"{stats['cuda_peak_reserved_mib']:,.1f} MiB reserved")
            predicted = f"predicted step peak {self.predicted_mib:,.1f} MiB" if self.predicted_mib is not None else ""
        else:
            values["baseline_rss_mib"] = round(self.baseline_rss_mib or 0.0, 1)
            measured = f"peak RSS {stats['peak_rss_mib']:,.1f} MiB (the runtime and compiler included)"
            predicted = (f"predicted step peak {self.predicted_mib:,.1f} MiB + {values['baseline_rss_mib']:,.1f} MiB "
                         f"RSS before the model = {self.predicted_mib + values['baseline_rss_mib']:,.1f} MiB"
                         if self.predicted_mib is not None else "")
        if predicted and not self.compiled:
            predicted += " (the plan is the compiled step's; this eager step keeps more)"
        logger.echo(f"memory ({when}, step {step}): {measured}" + (f"; {predicted}" if predicted else ""))
        logger.record("memory", step, when=when, **values)
        if self.device.type == "cuda" and when == "first step":
            torch.cuda.reset_peak_memory_stats(self.device)
        return values
