"""Megatron's pretraining samplers: which sample indices each data-parallel rank reads, resumable
from ``consumed_samples`` (the only sampler state a checkpoint needs).

``SequentialSampler`` (``dataloader_type=single``): the global batch of ``micro * dp`` consecutive
indices starting at ``consumed_samples``; rank r takes ``[r * micro, (r + 1) * micro)`` of it.
``RandomSampler`` (``cyclic``): each epoch is a ``torch.randperm`` seeded by the epoch number; with
``data_sharding`` every rank permutes its own contiguous bucket, without it all ranks share one
permutation and take every dp-th index. Incomplete last batches are dropped.
"""

from __future__ import annotations

from typing import Iterator

import torch

from lmfunc.config.model import ConfigError


def _check(total: int, consumed: int, micro: int, rank: int, dp: int) -> None:
    if total <= 0:
        raise ConfigError(f"the dataset has no samples (total_samples={total})")
    if micro <= 0 or dp <= 0:
        raise ConfigError(f"micro_batch_size ({micro}) and data-parallel size ({dp}) must be positive")
    if not 0 <= rank < dp:
        raise ConfigError(f"data-parallel rank {rank} is outside [0, {dp})")
    if consumed < 0:
        raise ConfigError(f"consumed_samples must be >= 0, got {consumed}")


class SequentialSampler:
    """Megatron's ``MegatronPretrainingSampler``: yields this rank's micro-batches of indices."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, rank: int = 0,
                 data_parallel_size: int = 1):
        _check(total_samples, consumed_samples, micro_batch_size, rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ConfigError(f"consumed_samples ({consumed_samples}) is not below the dataset's {total_samples} samples")
        self.total, self.consumed = total_samples, consumed_samples
        self.micro, self.rank, self.dp = micro_batch_size, rank, data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        width = self.micro * self.dp
        begin = self.rank * self.micro
        for start in range(self.consumed, self.total - width + 1, width):
            yield list(range(start + begin, start + begin + self.micro))


class RandomSampler:
    """Megatron's ``MegatronPretrainingRandomSampler`` (``cyclic``): yields this rank's micro-batches
    forever, epoch after epoch, each epoch permuted by ``torch.Generator().manual_seed(epoch)``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, rank: int = 0,
                 data_parallel_size: int = 1, data_sharding: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, rank, data_parallel_size)
        width = micro_batch_size * data_parallel_size
        self.active = total_samples - total_samples % width
        if self.active == 0:
            raise ConfigError(f"{total_samples} samples are fewer than one global micro-batch of {width}")
        self.total, self.consumed = total_samples, consumed_samples
        self.micro, self.rank, self.dp, self.sharding = micro_batch_size, rank, data_parallel_size, data_sharding

    def _epoch_indices(self, epoch: int, offset: int) -> list[int]:
        generator = torch.Generator()
        generator.manual_seed(epoch)
        if self.sharding:
            bucket = (self.total // (self.micro * self.dp)) * self.micro
            order = torch.randperm(bucket, generator=generator)[offset // self.dp :]
            return (self.rank * bucket + order).tolist()
        full = (self.total // self.micro) * self.micro
        return torch.randperm(full, generator=generator)[offset:][self.rank :: self.dp].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        width = self.micro * self.dp
        while True:
            epoch, offset = divmod(self.consumed, self.active)
            if offset % width:
                raise ConfigError(f"consumed_samples ({self.consumed}) is not a multiple of micro x dp = {width}")
            indices = self._epoch_indices(epoch, offset)
            for start in range(0, len(indices) - self.micro + 1, self.micro):
                self.consumed += width
                yield indices[start : start + self.micro]
                if self.consumed % self.active == 0:
                    break
