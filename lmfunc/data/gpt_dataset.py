"""Megatron's ``GPTDataset``: fixed-length samples over an indexed dataset, with its exact indices.

For one split (a range of the dataset's sequences) with T tokens per epoch, N requested samples
and sequence length S (megatron.md section 2):

1. epochs E: the smallest E >= 1 with E*T >= N*S + 1;
2. separate final epoch when E > 1 and the last epoch is needed for fewer than 80% of its samples;
3. document index: the split's sequence ids tiled E times and shuffled with
   ``numpy.random.RandomState(seed)`` (the final epoch shuffled on its own when separate);
4. sample index: sample k is ``stream[k*S : k*S + S + 1]`` of the concatenated documents; row k
   holds (position in the document index, offset) of token k*S;
5. shuffle index: a permutation of the samples (the final epoch's samples shuffled on their own).

Indices are cached as ``.npy`` files named by an MD5 of everything they depend on; they are
written under temporary names and renamed, description last, so a reader never sees a partial
cache and two processes building the same cache cannot corrupt it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lmfunc.config.model import ConfigError
from lmfunc.data.cache import cached_arrays
from lmfunc.data.indexed import IndexedDataset


@dataclass(frozen=True)
class GPTIndices:
    """``document_index`` [E * docs] int32, ``sample_index`` [samples + 1, 2], ``shuffle_index`` [samples]."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Smallest E >= 1 with ``E * tokens_per_epoch >= num_samples * seq_length + 1``."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ConfigError(f"the split holds no tokens but {num_samples} samples were requested; change data.split")
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Rows ``(i, offset)`` for k = 0..num_samples: token ``k * S`` of the stream lies at ``offset`` of
    ``document_index[i]`` (row 0 is (0, 0), as in Megatron)."""
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_positions = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[doc_positions] - lengths[doc_positions])
    dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < 2**31 else np.int64
    index = np.stack([doc_positions, offsets], axis=1).astype(dtype)
    index[0] = 0
    return index


def build_indices(sizes: np.ndarray, split_ids: np.ndarray, seq_length: int, num_samples: Optional[int],
                  seed: int) -> GPTIndices:
    """The three Megatron indices of a split whose sequences are ``split_ids`` (lengths ``sizes``)."""
    tokens = int(sizes[split_ids].sum(dtype=np.int64))
    if 0 < tokens < seq_length + 1:
        raise ConfigError(
            f"data.seq_length ({seq_length}) is longer than the split's {tokens} tokens (all its documents combined); "
            "lower data.seq_length or use more data"
        )
    epochs = num_epochs(tokens, seq_length, num_samples)
    separate = False
    if epochs > 1:
        samples_before_last = ((epochs - 1) * tokens - 1) // seq_length
        per_epoch = (tokens - 1) // seq_length
        separate = (num_samples - samples_before_last) < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    ids = split_ids.astype(np.int32)
    if separate:
        first = np.tile(ids, epochs - 1)
        rng.shuffle(first)
        last = ids.copy()
        rng.shuffle(last)
        document_index = np.concatenate([first, last])
    else:
        document_index = np.tile(ids, epochs)
        rng.shuffle(document_index)
    total = (epochs * tokens - 1) // seq_length
    if total < 1:
        raise ConfigError(
            f"data.seq_length ({seq_length}) is longer than the split's {tokens} tokens; "
            "lower data.seq_length or use more data"
        )
    sample_index = build_sample_index(sizes, document_index, seq_length, total)
    shuffle_dtype = np.uint32 if total < 2**32 - 1 else np.int64
    if separate:
        head = np.arange(samples_before_last, dtype=shuffle_dtype)
        tail = np.arange(samples_before_last, total, dtype=shuffle_dtype)
        rng.shuffle(head)
        rng.shuffle(tail)
        shuffle_index = np.concatenate([head, tail])
    else:
        shuffle_index = np.arange(total, dtype=shuffle_dtype)
        rng.shuffle(shuffle_index)
    return GPTIndices(document_index, sample_index, shuffle_index)


class GPTDataset:
    """Samples of ``seq_length + 1`` token ids: ``ds[i]`` is an int64 array (Megatron's ``text``)."""

    def __init__(self, indexed: IndexedDataset, split_ids: np.ndarray, num_samples: Optional[int], seq_length: int,
                 seed: int, split: str = "train", cache_dir: Optional[str] = None):
        self.indexed, self.seq_length = indexed, seq_length
        description = {
            "class": "GPTDataset", "dataset_path": os.path.abspath(indexed.prefix), "split": split,
            "num_samples": num_samples, "seed": seed, "seq_length": seq_length,
            "split_range": [int(split_ids[0]), int(split_ids[-1]) + 1] if len(split_ids) else [0, 0],
            "num_sequences": len(indexed), "num_tokens": indexed.num_tokens,
        }
        sizes = np.asarray(indexed.sequence_lengths)
        arrays = cached_arrays(
            description, lambda: vars(build_indices(sizes, split_ids, seq_length, num_samples, seed)), cache_dir
        )
        self.document_index, self.sample_index, self.shuffle_index = (
            arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"],
        )

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def unshuffled(self, k: int) -> np.ndarray:
        """Sample ``k`` of the stream (before shuffling)."""
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[k], self.sample_index[k + 1]
        doc_beg, off_beg, doc_end, off_end = int(doc_beg), int(off_beg), int(doc_end), int(off_end)
        if doc_beg == doc_end:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1)]
        else:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg)]
            parts += [self.indexed.get(int(self.document_index[i])) for i in range(doc_beg + 1, doc_end)]
            parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.unshuffled(int(self.shuffle_index[i]))
