"""Megatron's indexed dataset (``MMIDIDX``): a ``.bin`` of token ids and its ``.idx`` index.

``.bin``: the token ids of all sequences, concatenated, little-endian, no header.
``.idx`` (little-endian): magic ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B`` dtype code,
``<Q`` N sequences, ``<Q`` M = documents + 1, then int32 sequence lengths [N], int64 byte
pointers into the .bin [N], int64 document indices [M] (0, then the number of sequences after
each document), and for multimodal datasets int8 sequence modes [N]. Files written here are
byte-identical to Megatron's ``IndexedDatasetBuilder``; files written by Megatron read here.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional, Sequence, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated or not in Megatron's format."""


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """Megatron's token dtype for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


class IndexedDatasetBuilder:
    """Streams sequences into ``bin_file`` and writes the index with ``finalize(idx_file)``.

    ``add_item(ids)`` appends one sequence; ``end_document()`` closes the current document;
    ``add_document(ids, lengths)`` appends a document of ``len(lengths)`` sequences at once;
    ``add_index(prefix)`` appends a whole existing dataset (its documents kept).
    """

    def __init__(self, bin_file: str, dtype: Union[type, np.dtype] = np.int32, multimodal: bool = False):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise IndexedDatasetError(f"dtype {self.dtype} has no Megatron code; use one of {sorted(map(str, _CODE_OF))}")
        self.bin_file, self.multimodal = bin_file, multimodal
        self._bin = open(bin_file, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] = []

    def add_item(self, ids: Union[Sequence[int], np.ndarray], mode: int = 0) -> None:
        array = np.asarray(ids, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, ids: Union[Sequence[int], np.ndarray], lengths: Sequence[int],
                     modes: Optional[Sequence[int]] = None) -> None:
        array = np.asarray(ids, dtype=self.dtype)
        if sum(lengths) != array.size:
            raise IndexedDatasetError(f"add_document: lengths sum to {sum(lengths)} but {array.size} ids were given")
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_index(self, prefix: str) -> None:
        other = IndexedDataset(prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot merge {prefix} (dtype {other.dtype}) into a {self.dtype} dataset")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(i) + offset for i in other.document_indices[1:])
        if self.multimodal:
            self.sequence_modes.extend(int(m) for m in other.sequence_modes)
        with open(bin_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def abort(self) -> None:
        """Close and delete the partial ``.bin`` (nothing is left that looks like a dataset)."""
        self._bin.close()
        if os.path.exists(self.bin_file):
            os.remove(self.bin_file)

    def finalize(self, idx_file: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._bin.close()
        write_index(idx_file, self.dtype, self.sequence_lengths, self.document_indices,
                    self.sequence_modes if self.multimodal else None)


def write_index(
    path: str, dtype: Union[type, np.dtype], sequence_lengths: Iterable[int], document_indices: Iterable[int],
    sequence_modes: Optional[Iterable[int]] = None,
) -> None:
    """Write a Megatron ``.idx`` file (pointers are derived from the lengths and the dtype)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(list(sequence_lengths), dtype=np.int32)
    documents = np.asarray(list(document_indices), dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(documents)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(documents.astype("<i8").tobytes(order="C"))
        if sequence_modes is not None:
            f.write(np.asarray(list(sequence_modes), dtype=np.int8).tobytes(order="C"))


class IndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx``; ``ds[i]`` is sequence ``i`` (a numpy array).

    Attributes: ``dtype``, ``sequence_lengths`` [N] int32, ``sequence_pointers`` [N] int64,
    ``document_indices`` [documents + 1] int64, ``sequence_modes`` [N] int8 (multimodal only).
    With ``mmap=True`` the token ids stay on disk (``numpy.memmap``).
    """

    def __init__(self, prefix: str, mmap: bool = True, multimodal: bool = False):
        self.prefix = prefix
        for path in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path} does not exist (a dataset prefix names PREFIX.bin and PREFIX.idx)")
        self._read_index(idx_path(prefix), multimodal)
        self._check_bin(bin_path(prefix))
        if mmap:
            self._tokens = np.memmap(bin_path(prefix), dtype=self.dtype, mode="r") if self._bin_bytes else np.empty(0, self.dtype)
        else:
            self._tokens = np.fromfile(bin_path(prefix), dtype=self.dtype)

    def _read_index(self, path: str, multimodal: bool) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES or header[:9] != MAGIC:
            raise IndexedDatasetError(f"{path} is not a Megatron MMIDIDX index (bad magic or shorter than its header)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{path} has index version {version}; only version {VERSION} exists")
        code, count, doc_count = header[17], *struct.unpack("<QQ", header[18:34])
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path} has unknown dtype code {code}; known codes: {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_BYTES + 12 * count + 8 * doc_count + (count if multimodal else 0)
        if size != expected:
            hint = " (was it written for a multimodal dataset? pass multimodal=True)" if size == expected + count else ""
            raise IndexedDatasetError(f"{path} holds {size} bytes but its header (N={count}, M={doc_count}) needs {expected}{hint}")
        index = np.memmap(path, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=count, offset=offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(index, dtype="<i8", count=doc_count, offset=offset)
        offset += 8 * doc_count
        self.sequence_modes = np.frombuffer(index, dtype=np.int8, count=count, offset=offset) if multimodal else None
        if doc_count < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise IndexedDatasetError(
                f"{path}: document indices must start at 0 and end at the number of sequences ({count})"
            )

    def _check_bin(self, path: str) -> None:
        """The ``.bin`` must hold exactly the bytes the ``.idx`` describes (Megatron writes them
        back to back): fewer is a truncated file, more a ``.bin`` of another dataset."""
        self._bin_bytes = os.path.getsize(path)
        needed = 0
        if len(self.sequence_lengths):
            needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if self._bin_bytes != needed:
            why = "truncated?" if self._bin_bytes < needed else "the .bin belongs to another (larger) dataset?"
            raise IndexedDatasetError(
                f"{path} holds {self._bin_bytes} bytes but its .idx describes exactly {needed} ({why}); "
                "pair each .bin with the .idx written with it, or run preprocess again"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``index`` (to its end when ``length`` is None)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {self.prefix} with {len(self)} sequences")
        index %= len(self)
        size = int(self.sequence_lengths[index])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {index} of length {size}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def document(self, index: int) -> np.ndarray:
        """All tokens of document ``index`` (its sequences concatenated)."""
        begin, end = int(self.document_indices[index]), int(self.document_indices[index + 1])
        parts = [self.get(i) for i in range(begin, end)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)
