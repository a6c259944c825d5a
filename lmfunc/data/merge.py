"""``python -m lmfunc.data.merge --input A B ... --output-prefix C``: join indexed datasets into one."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Sequence

import tyro

from lmfunc.data.indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError


@dataclasses.dataclass(frozen=True)
class MergeArgs:
    """Concatenate .bin/.idx datasets (documents kept, in the order given)."""

    input: tuple[str, ...]
    """Dataset prefixes (PREFIX.bin + PREFIX.idx) to join, in order."""
    output_prefix: str
    """Prefix of the merged dataset."""


def merge(prefixes: Sequence[str], output_prefix: str) -> None:
    """Write ``output_prefix.{bin,idx}`` holding ``prefixes``' documents in order (temp names, then rename)."""
    if not prefixes:
        raise IndexedDatasetError("merge needs at least one --input prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    tmp = f"{output_prefix}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
    except BaseException:
        builder.abort()
        raise
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", output_prefix + ".bin")
    os.replace(tmp + ".idx", output_prefix + ".idx")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = tyro.cli(MergeArgs, args=argv, prog="python -m lmfunc.data.merge")
    try:
        merge(args.input, args.output_prefix)
    except IndexedDatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {args.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
