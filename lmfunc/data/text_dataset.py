"""An in-memory GPT dataset over a list of documents (the embedded corpus or a text file).

Documents are tokenised, each followed by the end-of-document id, and concatenated into one
stream per split; the split is Megatron's (``"90,10,0"`` over documents, in order). Sample ``k``
of an epoch is ``stream[k*S : k*S + S + 1]`` (consecutive samples share one token, samples span
document boundaries, as Megatron's sample index does); the order of samples is reshuffled every
epoch from ``(seed, epoch)``. So the ``i``-th sample of a run is a pure function of
``(documents, split, S, seed, i)`` and a run resumes from ``consumed_samples`` exactly.
"""

from __future__ import annotations

import functools
import re
from typing import Optional, Sequence

import numpy as np

from lmfunc.config.model import ConfigError

SPLIT_NAMES = ("train", "valid", "test")


def split_ranges(split: str, num_documents: int) -> list[Optional[tuple[int, int]]]:
    """Megatron's split rule: ``[beg, end)`` document ranges for train/valid/test (None when empty).

    Weights are the numbers in ``split`` (padded to three, normalised); the bookends are rounded
    with ``round(fraction * num_documents)``.
    """
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ConfigError(f"data.split {split!r} must be one to three non-negative weights like '90,10,0'")
    weights = (weights + [0.0, 0.0])[:3]
    total = sum(weights)
    bounds, low = [], 0.0
    for weight in weights:
        high = low + weight / total
        beg, end = int(round(low * num_documents)), int(round(high * num_documents))
        bounds.append((beg, end) if end > beg else None)
        low = high
    return bounds


class TextDataset:
    """Samples of ``seq_length + 1`` token ids from one split's token stream."""

    def __init__(self, stream: np.ndarray, seq_length: int, seed: int, name: str = "train"):
        self.stream, self.seq_length, self.seed, self.name = stream, seq_length, seed, name
        self.samples_per_epoch = (len(stream) - 1) // seq_length
        if self.samples_per_epoch < 1:
            raise ConfigError(
                f"the {name} split holds {len(stream)} tokens, fewer than data.seq_length + 1 = {seq_length + 1}; "
                "lower data.seq_length, change data.split, or use more text"
            )

    def __len__(self) -> int:
        return self.samples_per_epoch

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.samples_per_epoch)

    def samples(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start+count-1`` of the run (epochs repeat, reshuffled): ``[count, S+1]`` int64."""
        out = np.empty((count, self.seq_length + 1), dtype=np.int64)
        for row, index in enumerate(range(start, start + count)):
            epoch, k = divmod(index, self.samples_per_epoch)
            begin = int(self._order(epoch)[k]) * self.seq_length
            out[row] = self.stream[begin : begin + self.seq_length + 1]
        return out


def token_stream(documents: Sequence[str], tokenizer) -> np.ndarray:
    """Tokens of ``documents``, each followed by ``tokenizer.eod``, as one int32 array."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eod)
    return np.asarray(ids, dtype=np.int32)


def build_splits(
    documents: Sequence[str], tokenizer, split: str, seq_length: int, seed: int
) -> dict[str, Optional[TextDataset]]:
    """``{"train", "valid", "test"}`` datasets (None for an empty split) over ``documents``."""
    datasets: dict[str, Optional[TextDataset]] = {}
    for name, bounds in zip(SPLIT_NAMES, split_ranges(split, len(documents))):
        if bounds is None:
            datasets[name] = None
            continue
        stream = token_stream(documents[bounds[0] : bounds[1]], tokenizer)
        datasets[name] = TextDataset(stream, seq_length, seed, name)
    return datasets
