"""Tokenizers, none downloaded: ``ByteTokenizer`` (no files: ids 0-255 are UTF-8 bytes, then EOD and
PAD), ``HFTokenizer`` (a local Hugging Face ``tokenizer.json``) and byte-level BPE training."""

from __future__ import annotations

import os
from typing import Iterable, Optional

import numpy as np

from lmfunc.config.model import ConfigError


class ByteTokenizer:
    """Byte-level tokenizer: ``encode`` gives the UTF-8 bytes of the text as ids 0-255.

    ``eod`` (256) ends a document and ``pad`` (257) fills; ``vocab_size`` is 258 before padding.
    """

    vocab_size = 258
    eod = 256
    pad = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int32 array, without a Python list (for very long texts)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids in ``ids`` (special ids dropped, invalid UTF-8 replaced)."""
        return bytes(i for i in (int(t) for t in ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` package; nothing is downloaded).

    ``eod`` is the id of ``eod_token``, or of the first of ``EOD_TOKENS`` the vocabulary holds.
    """

    def __init__(self, path: str, eod_token: Optional[str] = None):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"tokenizer file {file} does not exist")
        try:
            self._tokenizer = Tokenizer.from_file(file)
        except Exception as err:  # the Rust side raises plain Exceptions
            raise ConfigError(f"{file} is not a readable Hugging Face tokenizer.json: {err}") from None
        self.path = file
        candidates = (eod_token,) if eod_token is not None else EOD_TOKENS
        ids = [self._tokenizer.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ConfigError(
                f"{file} has no end-of-document token among {list(candidates)}; name one with the tokenizer's eod_token"
            )
        self.eod = found[0]
        pad = self._tokenizer.token_to_id("<pad>")
        self.pad = pad if pad is not None else None
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def load_tokenizer(spec: str, eod_token: Optional[str] = None):
    """``"byte"`` -> ``ByteTokenizer``; a ``tokenizer.json`` file (or a directory holding one) -> ``HFTokenizer``."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec) or spec.endswith(".json"):
        return HFTokenizer(spec, eod_token)
    raise ConfigError(f"unknown tokenizer {spec!r}: use 'byte' or the path of a Hugging Face tokenizer.json")


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = "<|endoftext|>"):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 style: every byte representable) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(f"vocab size {vocab_size} is below the {len(alphabet)} byte symbols + 1 special token")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod_token], initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer
