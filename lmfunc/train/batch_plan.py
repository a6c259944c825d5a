"""Megatron's batch-size arithmetic: microbatches per step, batch-size ramp-up, run length.

``num_microbatches = global_batch_size / (micro_batch_size * data_parallel_size)``. With a ramp-up
``(start, increment, ramp_samples)`` the global batch is ``start + floor(consumed / per_increment)
* increment`` (``per_increment = ramp_samples / ((global - start) / increment)``) until
``consumed > ramp_samples``, then ``global_batch_size`` (``RampupBatchsizeNumMicroBatchesCalculator``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmfunc.config.train import RunConfig, resolve_global_batch_size


@dataclass(frozen=True)
class BatchPlan:
    """Batch sizes of a run (validated by ``TrainConfig.validate``)."""

    micro_batch_size: int
    global_batch_size: int
    data_parallel_size: int = 1
    rampup_batch_size: Optional[tuple[int, int, int]] = None

    @classmethod
    def from_config(cls, run: RunConfig, data_parallel_size: int = 1) -> "BatchPlan":
        return cls(run.micro_batch_size, resolve_global_batch_size(run, data_parallel_size), data_parallel_size,
                   run.rampup_batch_size)

    def global_batch_at(self, consumed_samples: int) -> int:
        """Global batch size of the step that starts after ``consumed_samples`` sequences."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        num_increments = (self.global_batch_size - start) // increment
        if consumed_samples > ramp_samples or num_increments == 0:
            return self.global_batch_size
        per_increment = ramp_samples / num_increments
        return start + int(consumed_samples / per_increment) * increment

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Microbatches (per data-parallel rank) of the step that starts after ``consumed_samples``."""
        return self.global_batch_at(consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def train_iters_for_samples(self, train_samples: int) -> int:
        """Steps of a sample-based run, as Megatron's ``update_train_iters`` counts them (the last
        partial global batch is dropped)."""
        if self.rampup_batch_size is None:
            return train_samples // self.global_batch_size
        iterations, consumed = 0, 0
        while consumed <= self.rampup_batch_size[2] and consumed <= train_samples:
            consumed += self.global_batch_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def samples_before_steps(self, num_steps: int, start: int = 0) -> list[int]:
        """``[consumed samples before step 0, 1, ..., num_steps]`` (length ``num_steps + 1``) of a run
        that has consumed ``start`` samples before its step 0 (a resumed run)."""
        consumed = [start]
        for _ in range(num_steps):
            consumed.append(consumed[-1] + self.global_batch_at(consumed[-1]))
        return consumed
