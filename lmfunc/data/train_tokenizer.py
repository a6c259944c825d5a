"""``python -m lmfunc.data.train_tokenizer``: train a byte-level BPE ``tokenizer.json`` on local text."""

from __future__ import annotations

import dataclasses
import glob
import json
import sys
from typing import Iterator, Optional, Sequence

import tyro

from lmfunc.config.model import ConfigError
from lmfunc.data.tokenizer import train_byte_level_bpe


@dataclasses.dataclass(frozen=True)
class TrainTokenizerArgs:
    """Train a byte-level BPE tokenizer (GPT-2 style) on text or JSON-lines files."""

    input: tuple[str, ...]
    """Input files or globs: .jsonl/.json files are read line by line (the --json-key field); others as text."""
    vocab_size: int
    """Size of the vocabulary, the end-of-document token included."""
    output: str
    """Where to write the tokenizer.json."""
    json_key: str = "text"
    """Field of each JSON line that holds the text."""
    eod_token: str = "<|endoftext|>"
    """The end-of-document special token."""


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """The files named by ``patterns`` (globs expanded, sorted), or a ConfigError naming an empty one."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern))
        if not matched:
            raise ConfigError(f"--input {pattern} matches no file")
        files.extend(matched)
    return files


def read_texts(files: Sequence[str], json_key: str) -> Iterator[str]:
    """Texts of ``files``: one per JSON line (field ``json_key``) for .jsonl/.json, one per text file."""
    for path in files:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)[json_key]
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise ConfigError(f"{path}:{number}: not a JSON object with a {json_key!r} field ({err})") from None
        else:
            with open(path, encoding="utf-8") as f:
                yield f.read()


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = tyro.cli(TrainTokenizerArgs, args=argv, prog="python -m lmfunc.data.train_tokenizer")
    try:
        tokenizer = train_byte_level_bpe(read_texts(expand_inputs(args.input), args.json_key), args.vocab_size,
                                         args.eod_token)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    tokenizer.save(args.output)
    print(f"wrote {args.output}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
