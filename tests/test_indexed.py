import struct

import numpy as np
import pytest

from lmfunc.data.indexed import (
    IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, optimal_dtype, write_index,
)


def megatron_idx_bytes(code: int, itemsize: int, lengths: list[int], doc_indices: list[int]) -> bytes:
    """The .idx bytes as megatron.md section 1 lays them out, written independently of lmfunc."""
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * itemsize
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
            + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
            + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
            + struct.pack(f"<{len(doc_indices)}q", *doc_indices))


def build(prefix: str, docs: list[list[list[int]]], dtype=np.uint16) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        for sentence in doc:
            builder.add_item(sentence)
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_files_are_byte_identical_to_the_format(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[list(rng.integers(0, 50000, rng.integers(1, 9))) for _ in range(k)] for k in (3, 1, 0, 2)]
    prefix = str(tmp_path / "ds")
    build(prefix, docs)
    lengths = [len(s) for d in docs for s in d]
    doc_indices = list(np.cumsum([0] + [len(d) for d in docs]))
    assert open(prefix + ".idx", "rb").read() == megatron_idx_bytes(8, 2, lengths, doc_indices)
    tokens = [t for d in docs for s in d for t in s]
    assert open(prefix + ".bin", "rb").read() == np.asarray(tokens, dtype="<u2").tobytes()


def test_megatrons_size_example_20_documents_49_sentences(tmp_path):
    prefix = str(tmp_path / "ex")
    sentences = [2] * 11 + [3] * 9  # 11 docs of 2 sentences, 9 of 3: 49 sentences in 20 docs
    build(prefix, [[[1, 2, 3]] * k for k in sentences])
    assert len(open(prefix + ".idx", "rb").read()) == 790


def test_reads_what_megatron_writes(tmp_path):
    prefix = str(tmp_path / "theirs")
    lengths, doc_indices = [4, 2, 3], [0, 2, 3]
    open(prefix + ".idx", "wb").write(megatron_idx_bytes(4, 4, lengths, doc_indices))
    np.arange(9, dtype="<i4").tofile(prefix + ".bin")
    for mmap in (True, False):
        ds = IndexedDataset(prefix, mmap=mmap)
        assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2 and ds.num_tokens == 9
        assert ds[1].tolist() == [4, 5] and ds.get(2, offset=1, length=2).tolist() == [7, 8]
        assert ds.document(0).tolist() == [0, 1, 2, 3, 4, 5] and ds[-1].tolist() == [6, 7, 8]


def test_merge_keeps_documents_and_tokens(tmp_path):
    a, b, merged = (str(tmp_path / n) for n in ("a", "b", "merged"))
    build(a, [[[1, 2], [3]], [[4]]])
    build(b, [[[5, 6, 7]]])
    builder = IndexedDatasetBuilder(merged + ".bin", np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")
    ds = IndexedDataset(merged)
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert [ds.document(i).tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6, 7]]


def test_dtype_follows_megatron():
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(128256) == np.int32 and optimal_dtype(None) == np.int32


def test_bad_files_are_named(tmp_path):
    prefix = str(tmp_path / "bad")
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx does not exist"):
        IndexedDataset(prefix)
    np.arange(4, dtype="<i4").tofile(prefix + ".bin")
    open(prefix + ".idx", "wb").write(b"NOTANIDX" * 5)
    with pytest.raises(IndexedDatasetError, match="not a Megatron MMIDIDX index"):
        IndexedDataset(prefix)
    good = megatron_idx_bytes(4, 4, [4, 4], [0, 2])
    open(prefix + ".idx", "wb").write(good[:-8])
    with pytest.raises(IndexedDatasetError, match=r"holds 66 bytes but its header \(N=2, M=2\) needs 74"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(good)
    with pytest.raises(IndexedDatasetError, match=r"bad\.bin holds 16 bytes but its \.idx describes exactly 32 \(truncated\?\)"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(IndexedDatasetError, match="has index version 2; only version 1 exists"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(good[:17] + bytes([9]) + good[18:])
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 9"):
        IndexedDataset(prefix)
    write_index(prefix + ".idx", np.int32, [2, 2], [0, 1])
    with pytest.raises(IndexedDatasetError, match="document indices must start at 0 and end at the number of sequences"):
        IndexedDataset(prefix)
