"""Tokenizers. ``ByteTokenizer`` needs no files: ids 0-255 are UTF-8 bytes, then EOD and PAD."""

from __future__ import annotations

from typing import Iterable


class ByteTokenizer:
    """Byte-level tokenizer: ``encode`` gives the UTF-8 bytes of the text as ids 0-255.

    ``eod`` (256) ends a document and ``pad`` (257) fills; ``vocab_size`` is 258 before padding.
    """

    vocab_size = 258
    eod = 256
    pad = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids in ``ids`` (special ids dropped, invalid UTF-8 replaced)."""
        return bytes(i for i in (int(t) for t in ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple
