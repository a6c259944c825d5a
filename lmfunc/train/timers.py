"""Per-phase timers of the training loop, reduced across ranks to find stragglers (Megatron's timers).

Phases: ``data`` (waiting for the next batch), ``step`` (the train step until its results are
ready), ``eval``, ``save`` (the blocking part of a checkpoint save) and ``log``. At level 2 the
step is split into ``step_host`` (until the step call returns: tracing, dispatch, and on the CPU
the compute itself) and ``step_device`` (then waiting for the device's results). At each log
interval every rank's totals are gathered; each phase is reported as the max and min over ranks
with the slowest rank's id.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch.distributed as dist

PHASES = ("data", "step", "step_host", "step_device", "eval", "save", "log")
LEVEL_PHASES = {0: (), 1: ("data", "step", "eval", "save", "log"), 2: PHASES}
"""Phases reported at each ``log.timers`` level."""


class PhaseTimers:
    """Seconds per phase since the last report, on this rank."""

    def __init__(self, level: int) -> None:
        if level not in LEVEL_PHASES:
            raise ValueError(f"timer level must be 0, 1 or 2, got {level}")
        self.level = level
        self.phases = LEVEL_PHASES[level]
        self.totals: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the block to ``name``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - began)

    def add(self, name: str, seconds: float) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown timer phase {name!r}; phases: {PHASES}")
        self.totals[name] += seconds

    def report(self) -> dict[str, float]:
        """``{phase}_max``, ``{phase}_min`` (seconds) and ``{phase}_slowest_rank`` over all ranks (a
        collective when a process group exists: every rank calls it at the same step); resets the
        totals. Empty at level 0."""
        if not self.phases:
            return {}
        local = {name: self.totals.get(name, 0.0) for name in self.phases}
        self.totals = defaultdict(float)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        out: dict[str, float] = {}
        for name in self.phases:
            values = [rank_times[name] for rank_times in gathered]
            slowest = max(range(len(values)), key=values.__getitem__)
            out[f"{name}_max"] = round(values[slowest], 6)
            out[f"{name}_min"] = round(min(values), 6)
            out[f"{name}_slowest_rank"] = slowest
        return out


def format_timers(report: dict[str, float], ranks: int) -> str:
    """One console line: each phase's max seconds, and with several ranks min/max and the slowest rank."""
    parts = []
    for name in PHASES:
        if f"{name}_max" not in report:
            continue
        text = f"{name} {report[f'{name}_max']:.3f}"
        if ranks > 1:
            text += f" [min {report[f'{name}_min']:.3f}, slowest rank {report[f'{name}_slowest_rank']}]"
        parts.append(text)
    return "timers (s per log interval, max over ranks): " + " | ".join(parts)
