"""Blends of datasets (Megatron's ``BlendedDataset``) and synthetic data (``MockIndexed``).

Blend syntax (``--data.path``): ``"0.3 prefixA 0.7 prefixB"`` (weights, normalised) or
``"prefixA prefixB"`` (unweighted: each dataset once, weighted by its size) or one prefix. For N
requested samples, dataset i is asked for ``ceil(ceil(N w_i) * 1.005)`` samples and the blend has
``sum_i ceil(N w_i)``; sample j comes from the dataset whose share lags most,
``argmax_i(w_i * max(j, 1) - taken_i)`` (lowest i on ties).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from lmfunc.config.model import ConfigError
from lmfunc.data.cache import cached_arrays


def parse_blend(spec: str) -> tuple[list[str], Optional[list[float]]]:
    """``(prefixes, weights)`` of a blend string; weights is None for an unweighted list."""
    tokens = spec.split()
    if not tokens:
        raise ConfigError("data.path is empty; give PREFIX, 'PREFIX_A PREFIX_B' or 'W_A PREFIX_A W_B PREFIX_B'")

    def number(token: str) -> Optional[float]:
        try:
            return float(token)
        except ValueError:
            return None

    if number(tokens[0]) is None:
        if any(number(t) is not None for t in tokens):
            raise ConfigError(f"data.path {spec!r} mixes weights and prefixes; write 'W_A PREFIX_A W_B PREFIX_B'")
        return tokens, None
    if len(tokens) % 2:
        raise ConfigError(f"data.path {spec!r}: weights don't parse; expected pairs 'WEIGHT PREFIX' but got {len(tokens)} words")
    weights = [number(t) for t in tokens[0::2]]
    prefixes = tokens[1::2]
    bad = [t for t, w in zip(tokens[0::2], weights) if w is None or w < 0 or not math.isfinite(w)]
    if bad or sum(weights) <= 0:
        raise ConfigError(f"data.path {spec!r}: weights {tokens[0::2]} must be non-negative numbers with a positive sum")
    if any(number(p) is not None for p in prefixes):
        raise ConfigError(f"data.path {spec!r}: weights don't parse; a prefix position holds a number")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_blending_indices``: (dataset of sample j [int16], its index there [int64])."""
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * len(weights)
    for j in range(size):
        scale = max(j, 1.0)
        best, best_error = 0, weights[0] * scale - taken[0]
        for i in range(1, len(weights)):
            error = weights[i] * scale - taken[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[j], sample_index[j] = best, taken[best]
        taken[best] += 1
    return dataset_index, sample_index


def component_sizes(weights: Sequence[float], num_samples: int) -> tuple[list[int], list[int]]:
    """(samples requested from each dataset, blend size per dataset) for ``num_samples`` blended samples."""
    targets = [math.ceil(num_samples * w) for w in weights]
    return [math.ceil(t * 1.005) for t in targets], targets


class BlendedDataset:
    """Samples drawn from ``datasets`` in proportion to ``weights``; ``ds[j]`` is component ``d``'s sample."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, split: str = "train",
                 cache_dir: Optional[str] = None, description: Optional[dict] = None):
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError(f"a blend needs one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        self.datasets, self.weights, self.size = list(datasets), list(weights), size
        key = {"class": "BlendedDataset", "split": split, "size": size, "weights": self.weights, **(description or {})}

        def build() -> dict[str, np.ndarray]:
            dataset_index, sample_index = blending_indices(self.weights, size)
            return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

        arrays = cached_arrays(key, build, cache_dir)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        for i, dataset in enumerate(self.datasets):
            needed = int(np.count_nonzero(np.asarray(self.dataset_index) == i))
            if needed > len(dataset):
                raise ConfigError(f"blend component {i} has {len(dataset)} samples but the blend takes {needed}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, j: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[j])][int(self.dataset_sample_index[j])]


class MockIndexed:
    """Megatron's mock low-level dataset: 100000 documents, lengths ``default_rng(0).integers(1, 4096)``;
    document i is ``(arange(len - 1) + 1) % vocab_size`` followed by ``eod``. Same interface as
    ``IndexedDataset`` for ``GPTDataset``."""

    prefix = "mock"

    def __init__(self, vocab_size: int, eod: int, num_documents: int = 100_000):
        self.vocab_size, self.eod = vocab_size, eod
        self.sequence_lengths = np.random.default_rng(0).integers(1, 4096, size=num_documents, dtype=np.int32)
        self.document_indices = np.arange(num_documents + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        size = int(self.sequence_lengths[index])
        document = np.concatenate([(np.arange(size - 1, dtype=np.int64) + 1) % self.vocab_size, [self.eod]])
        end = size if length is None else offset + length
        return document[offset:end]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)
