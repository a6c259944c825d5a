import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmfunc.config import ConfigError
from lmfunc.data.gpt_dataset import GPTDataset, build_indices, build_sample_index, num_epochs
from lmfunc.data.indexed import IndexedDataset, IndexedDatasetBuilder


def write_dataset(prefix: str, lengths: list[int]) -> IndexedDataset:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    start = 0
    for n in lengths:
        builder.add_item(np.arange(start, start + n))  # token value = stream position in file order
        builder.end_document()
        start += n
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def megatron_sample_index(sizes, document_index, seq_length, num_samples):
    """Megatron's helpers.cpp build_sample_idx loop, transcribed from its description as the spec."""
    rows = [(0, 0)]
    doc_pos, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[document_index[doc_pos]]) - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_pos, offset = doc_pos + 1, 0
        rows.append((doc_pos, offset))
    return np.array(rows)


lengths_strategy = st.lists(st.integers(0, 40), min_size=1, max_size=30).filter(lambda ls: sum(ls) >= 12)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, seq_length=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_one_epoch_covers_every_token_once_in_document_index_order(lengths, seq_length, seed):
    sizes = np.array(lengths, dtype=np.int32)
    ids = np.arange(len(sizes), dtype=np.int32)
    idx = build_indices(sizes, ids, seq_length, None, seed)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    stream = np.concatenate([np.arange(starts[d], starts[d] + sizes[d]) for d in idx.document_index])
    total = (len(stream) - 1) // seq_length
    assert len(idx.shuffle_index) == total
    assert sorted(idx.shuffle_index.tolist()) == list(range(total))  # a permutation
    np.testing.assert_array_equal(idx.sample_index, megatron_sample_index(sizes, idx.document_index, seq_length, total))
    again = build_indices(sizes, ids, seq_length, None, seed)
    assert all(np.array_equal(a, b) for a, b in zip(vars(idx).values(), vars(again).values()))


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_strategy, seq_length=st.integers(1, 10), seed=st.integers(0, 1000))
def test_dataset_samples_are_stream_windows(tmp_path_factory, lengths, seq_length, seed):
    ds_dir = tmp_path_factory.mktemp("ds")
    indexed = write_dataset(str(ds_dir / "d"), lengths)
    ds = GPTDataset(indexed, np.arange(len(lengths)), None, seq_length, seed)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    stream = np.concatenate([np.arange(starts[d], starts[d] + lengths[d]) for d in ds.document_index])
    for k in range(len(ds)):
        np.testing.assert_array_equal(ds.unshuffled(k), stream[k * seq_length : k * seq_length + seq_length + 1])
    covered = np.concatenate([ds.unshuffled(0)] + [ds.unshuffled(k)[1:] for k in range(1, len(ds))])
    np.testing.assert_array_equal(covered, stream[: len(ds) * seq_length + 1])


def test_epochs_and_the_separate_final_epoch():
    assert num_epochs(100, 10, 9) == 1 and num_epochs(100, 10, 10) == 2 and num_epochs(100, 10, None) == 1
    sizes = np.full(10, 10, dtype=np.int32)  # T = 100 tokens, 9 samples of 10 per epoch
    ids = np.arange(10, dtype=np.int32)
    separate = build_indices(sizes, ids, 10, 12, seed=1)  # 2 epochs; 3 of the final epoch's 9 samples needed
    assert len(separate.document_index) == 20
    assert sorted(separate.document_index[10:].tolist()) == list(range(10))  # final epoch shuffled on its own
    sans = (100 - 1) // 10
    assert sorted(separate.shuffle_index[:sans].tolist()) == list(range(sans))
    joint = build_indices(sizes, ids, 10, 17, seed=1)  # 8 of 9 needed: not separate
    assert sorted(joint.document_index.tolist()) == sorted(list(range(10)) * 2)
    other_seed = build_indices(sizes, ids, 10, 12, seed=2)
    assert other_seed.document_index.tolist() != separate.document_index.tolist()
    assert other_seed.shuffle_index.tolist() != separate.shuffle_index.tolist()


def test_cache_is_reused_only_for_identical_settings(tmp_path):
    indexed = write_dataset(str(tmp_path / "d"), [7, 13, 5, 20, 9])
    cache = str(tmp_path / "cache")
    first = GPTDataset(indexed, np.arange(5), 8, 4, seed=3, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(f.startswith(".tmp") for f in files)
    second = GPTDataset(indexed, np.arange(5), 8, 4, seed=3, cache_dir=cache)
    assert isinstance(second.shuffle_index, np.memmap)  # loaded from the cache
    assert [second[i].tolist() for i in range(len(second))] == [first[i].tolist() for i in range(len(first))]
    GPTDataset(indexed, np.arange(5), 8, 4, seed=4, cache_dir=cache)
    GPTDataset(indexed, np.arange(5), 8, 5, seed=3, cache_dir=cache)
    assert len(os.listdir(cache)) == 12  # a changed seed or length builds its own cache


def test_too_long_sequences_and_empty_splits_are_errors():
    sizes = np.array([3, 4], dtype=np.int32)
    with pytest.raises(ConfigError, match=r"data.seq_length \(10\) is longer than the split's 7 tokens"):
        build_indices(sizes, np.arange(2), 10, None, 0)
    with pytest.raises(ConfigError, match="the split holds no tokens but 5 samples were requested"):
        build_indices(sizes, np.arange(0), 2, 5, 0)


def test_sample_index_row_zero_is_zero_even_after_an_empty_document():
    sizes = np.array([0, 5, 5], dtype=np.int32)
    rows = build_sample_index(sizes, np.array([0, 1, 2]), 3, 3)
    np.testing.assert_array_equal(rows, megatron_sample_index(sizes, [0, 1, 2], 3, 3))
