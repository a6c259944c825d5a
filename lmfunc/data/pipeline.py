"""From a ``DataConfig`` to train/valid/test datasets, the Megatron way.

The token source is ``data.path`` (Megatron's blend syntax over ``.bin/.idx`` prefixes),
``data.mock`` (Megatron's synthetic documents), ``data.text_file`` or, by default, the embedded
corpus; text sources are tokenised once into a ``.bin/.idx`` pair in the cache directory. Each
prefix is split over its sequences with ``data.split``; each split is a ``GPTDataset`` asked for
Megatron's sample counts, and several prefixes are blended with ``BlendedDataset``.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional, Sequence

import numpy as np

from lmfunc.config.model import ConfigError
from lmfunc.config.train import DataConfig
from lmfunc.data.blend import BlendedDataset, MockIndexed, component_sizes, parse_blend
from lmfunc.data.corpus import embedded_documents, text_file_documents
from lmfunc.data.gpt_dataset import GPTDataset
from lmfunc.data.indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, dataset_exists, optimal_dtype

SPLIT_NAMES = ("train", "valid", "test")


def split_ranges(split: str, num_sequences: int) -> list[Optional[tuple[int, int]]]:
    """Megatron's split rule: ``[beg, end)`` sequence ranges for train/valid/test (None when empty).

    Weights are the numbers in ``split`` (padded to three, normalised); the bookends are rounded
    with ``round(fraction * num_sequences)``.
    """
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ConfigError(f"data.split {split!r} must be one to three non-negative weights with a positive sum, like '969,30,1'")
    weights = (weights + [0.0, 0.0])[:3]
    total = sum(weights)
    bounds, low = [], 0.0
    for weight in weights:
        high = low + weight / total
        beg, end = int(round(low * num_sequences)), int(round(high * num_sequences))
        bounds.append((beg, end) if end > beg else None)
        low = high
    return bounds


def tokenize_documents(documents: Sequence[str], tokenizer, prefix: str) -> None:
    """Write ``documents`` (each followed by EOD) as the dataset ``prefix``, atomically."""
    tmp = f"{prefix}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", optimal_dtype(tokenizer.vocab_size))
    for doc in documents:
        ids = tokenizer.encode(doc)
        if ids:
            builder.add_document(ids + [tokenizer.eod], [len(ids) + 1])
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")


def _text_source(data: DataConfig, tokenizer, cache_dir: str) -> str:
    """The prefix of the tokenised text source (built on first use)."""
    if data.text_file is not None:
        stat = os.stat(data.text_file) if os.path.exists(data.text_file) else None
        key = f"text:{os.path.abspath(data.text_file)}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"
        name = "text"
    else:
        key, name = "embedded:pydoc_data.topics", "embedded"
    key += f":{tokenizer!r}:{tokenizer.vocab_size}"
    prefix = os.path.join(cache_dir, f"{name}-{hashlib.md5(key.encode()).hexdigest()[:12]}")
    if not dataset_exists(prefix):
        documents = text_file_documents(data.text_file) if data.text_file is not None else embedded_documents()
        os.makedirs(cache_dir, exist_ok=True)
        tokenize_documents(documents, tokenizer, prefix)
    return prefix


def _open(prefix: str) -> IndexedDataset:
    try:
        dataset = IndexedDataset(prefix)
    except IndexedDatasetError as err:
        raise ConfigError(f"data.path: {err}") from None
    if dataset.num_tokens == 0:
        raise ConfigError(f"data.path: {prefix} holds no tokens ({dataset.num_documents} documents, all "
                          "empty: was the input .jsonl empty?); preprocess a non-empty input or drop it from the blend")
    return dataset


def _sources(spec: str) -> tuple[list, list[float]]:
    prefixes, weights = parse_blend(spec)
    sources = [_open(p) for p in prefixes]
    if weights is None:
        sizes = [float(s.num_tokens) for s in sources]
        weights = [w / sum(sizes) for w in sizes]
    return sources, weights


def _split_dataset(sources: list, weights: list[float], ranges: list, requested: int, name: str, data: DataConfig,
                   seed: int, cache_dir: str) -> Optional[object]:
    per_source, targets = component_sizes(weights, requested) if len(sources) > 1 else ([requested], [requested])
    parts = []
    for source, n, bounds in zip(sources, per_source, ranges):
        if bounds is None:
            return None
        parts.append(GPTDataset(source, np.arange(*bounds, dtype=np.int32), n, data.seq_length, seed, name, cache_dir))
    if len(parts) == 1:
        return parts[0]
    description = {"prefixes": [s.prefix for s in sources], "seq_length": data.seq_length, "seed": seed}
    return BlendedDataset(parts, weights, sum(targets), name, cache_dir, description)


# Megatron's BlendedMegatronDatasetConfig replaces the split of mock data with "1,1,1".
MOCK_SPLIT = "1,1,1"


def build_datasets(data: DataConfig, tokenizer, num_samples: dict[str, int], seed: int,
                   cache_dir: str) -> dict[str, Optional[object]]:
    """``{"train", "valid", "test"}`` datasets (None for an empty split or zero requested samples)."""
    per_split = {"train": data.train_path, "valid": data.valid_path, "test": data.test_path}
    shared = None
    if data.train_path is None:
        if data.path is not None:
            shared = _sources(data.path)
        elif data.mock:
            shared = [MockIndexed(tokenizer.vocab_size, tokenizer.eod)], [1.0]
        else:
            shared = [_open(_text_source(data, tokenizer, cache_dir))], [1.0]
    datasets: dict[str, Optional[object]] = {}
    for split_number, name in enumerate(SPLIT_NAMES):
        requested = num_samples.get(name, 0)
        if requested <= 0 or (shared is None and per_split[name] is None):
            datasets[name] = None
            continue
        if shared is None:
            sources, weights = _sources(per_split[name])
            ranges = [(0, len(s)) for s in sources]
        else:
            sources, weights = shared
            split = MOCK_SPLIT if data.mock else data.split
            ranges = [split_ranges(split, len(s))[split_number] for s in sources]
        datasets[name] = _split_dataset(sources, weights, ranges, requested, name, data, seed, cache_dir)
    return datasets
