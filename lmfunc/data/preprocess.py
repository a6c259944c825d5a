"""``python -m lmfunc.data.preprocess``: JSON lines -> Megatron ``.bin/.idx`` (one pair per json key).

Megatron's ``tools/preprocess_data.py`` interface: ``--input`` (a file, a directory of .jsonl/.json
files, or a glob), ``--output-prefix``, ``--tokenizer``, ``--json-keys``, ``--append-eod``,
``--workers``, ``--partitions``, ``--split-sentences``. Output files are
``{prefix}_{key}_{document|sentence}.{bin,idx}``. The input is streamed (memory stays flat), lines
keep their order, and outputs are written under temporary names and renamed only when complete.
With ``--partitions P`` lines are dealt round-robin to P partitions that are merged partition by
partition, so documents come out in Megatron's order 0, P, 2P, ..., 1, P+1, ...
"""

from __future__ import annotations

import dataclasses
import glob
import json
import multiprocessing
import os
import re
import sys
import tempfile
import threading
import time
from typing import Iterator, Optional, Sequence

import numpy as np
import tyro
from tqdm import tqdm

from lmfunc.config.model import ConfigError
from lmfunc.data.indexed import IndexedDatasetBuilder, optimal_dtype
from lmfunc.data.tokenizer import load_tokenizer

_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "fig", "no", "vol"}
_BOUNDARY = re.compile(r"(?<=[.!?])([\"')\]]*)\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence split: after ``.``/``!``/``?`` (and closing quotes) followed by space and a
    capital or digit, except after common abbreviations and single initials."""
    sentences, start = [], 0
    for match in _BOUNDARY.finditer(text):
        head = text[start : match.start()]
        last_word = head.rsplit(None, 1)[-1].rstrip(".!?").lower() if head.split() else ""
        if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
            continue
        sentences.append(text[start : match.start() + len(match.group(1))].strip())
        start = match.end()
    sentences.append(text[start:].strip())
    return [s for s in sentences if s]


@dataclasses.dataclass(frozen=True)
class PreprocessArgs:
    """Tokenize JSON lines into Megatron .bin/.idx files."""

    input: str
    """A .jsonl/.json file, a directory of them, or a glob."""
    output_prefix: str
    """Output files are {prefix}_{key}_{document|sentence}.{bin,idx}."""
    tokenizer: str = "byte"
    """'byte' or the path of a Hugging Face tokenizer.json (nothing is downloaded)."""
    json_keys: tuple[str, ...] = ("text",)
    """Fields of each JSON line to tokenize; one .bin/.idx pair each."""
    append_eod: bool = False
    """Append the end-of-document token to each (non-empty) document."""
    split_sentences: bool = False
    """Store each sentence as its own sequence (rule-based splitter)."""
    workers: int = 1
    """Tokenizer processes."""
    partitions: int = 1
    """Deal lines round-robin into this many partitions, then merge them (Megatron's order)."""
    skip_bad_lines: bool = False
    """Skip malformed JSON lines and lines without a json key (and report the count) instead of stopping."""


def input_files(spec: str) -> list[str]:
    """The files an ``--input`` names, sorted; a clear error if there are none."""
    if os.path.isdir(spec):
        files = sorted(glob.glob(os.path.join(spec, "*.jsonl")) + glob.glob(os.path.join(spec, "*.json")))
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(glob.glob(spec))
    if not files:
        raise ConfigError(f"--input {spec} names no file (a .jsonl file, a directory of .jsonl/.json files, or a glob)")
    return files


def read_lines(files: Sequence[str]) -> Iterator[tuple[str, int, bytes]]:
    """``(file, line number, raw line)`` for every non-blank line, streamed."""
    for path in files:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield path, number, line


_TOKENIZER = None


def _init_worker(tokenizer_spec: str) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(tokenizer_spec)


def encode_line(job: tuple[str, int, bytes, tuple[str, ...], bool, bool]) -> tuple[str, int, int, object]:
    """``(file, line, bytes, result)``: result is ``{key: [sentence ids, ...]}`` or an error message."""
    path, number, raw, keys, split, append_eod = job
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        return path, number, len(raw), f"invalid UTF-8 at byte {err.start}"
    except json.JSONDecodeError as err:
        return path, number, len(raw), f"malformed JSON ({err.msg} at column {err.colno})"
    if not isinstance(record, dict):
        return path, number, len(raw), "a line must hold a JSON object"
    out = {}
    for key in keys:
        if key not in record:
            return path, number, len(raw), f"missing json key {key!r} (keys: {sorted(record)[:10]})"
        value = record[key]
        texts = [str(t) for t in (value if isinstance(value, list) else [value])]
        if split:
            texts = [s for t in texts for s in split_sentences(t)]
        sentences = [ids for ids in (_TOKENIZER.encode_array(t) for t in texts) if ids.size]
        if sentences and append_eod:
            sentences[-1] = np.append(sentences[-1], np.int32(_TOKENIZER.eod))
        out[key] = sentences
    return path, number, len(raw), out


class _BoundedFeed:
    """Jobs for ``Pool.imap`` with at most ``window`` in flight. ``Pool.imap`` alone reads its whole
    input ahead, so memory would grow with the input; here its feeder thread waits for a free slot,
    and each result the consumer takes frees one. ``stop()`` releases a waiting feeder."""

    def __init__(self, jobs: Iterator, window: int):
        self.jobs, self.slots, self.stopped = jobs, threading.Semaphore(window), threading.Event()

    def __iter__(self) -> Iterator:
        for job in self.jobs:
            while not self.slots.acquire(timeout=0.1):
                if self.stopped.is_set():
                    return
            yield job

    def done_one(self) -> None:
        self.slots.release()

    def stop(self) -> None:
        self.stopped.set()


def output_prefixes(args: PreprocessArgs) -> dict[str, str]:
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def preprocess(args: PreprocessArgs, progress: bool = True) -> dict[str, int]:
    """Run the conversion; returns counts (documents, of which empty, and bad lines skipped)."""
    if args.workers < 1 or args.partitions < 1:
        raise ConfigError(f"--workers ({args.workers}) and --partitions ({args.partitions}) must be >= 1")
    files = input_files(args.input)
    tokenizer = load_tokenizer(args.tokenizer)
    dtype = optimal_dtype(tokenizer.vocab_size)
    prefixes = output_prefixes(args)
    _make_output_folder(args.output_prefix)
    workers = usable_workers(args.workers)
    tmp = {key: f"{p}.tmp-{os.getpid()}" for key, p in prefixes.items()}
    builders = {key: [] for key in tmp}
    try:
        for key, t in tmp.items():
            builders[key] = [IndexedDatasetBuilder(f"{t}-part{i}.bin", dtype) for i in range(args.partitions)]
        return _convert(args, files, workers, prefixes, tmp, builders, dtype, progress)
    except BaseException:
        _remove_partial_files(tmp, builders)
        raise


def usable_workers(requested: int) -> int:
    """``requested`` capped at the CPUs this process may run on (more only adds processes that
    wait); the cap is printed."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:
        available = os.cpu_count() or 1
    if requested > available:
        print(f"--workers {requested} capped at {available}: the CPUs available to this process", file=sys.stderr)
        return available
    return requested


def _make_output_folder(output_prefix: str) -> None:
    folder = os.path.dirname(os.path.abspath(output_prefix))
    blocker = next((p for p in _parents(folder) if os.path.exists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        raise ConfigError(f"--output-prefix {output_prefix}: {blocker} is a file, not a folder; pick another prefix")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"--output-prefix {output_prefix}: cannot write to {folder} ({err.strerror}); "
                          "pick a writable folder") from None


def _parents(path: str) -> list[str]:
    """``path`` and its parents, up to the root."""
    found = [path]
    while os.path.dirname(found[-1]) != found[-1]:
        found.append(os.path.dirname(found[-1]))
    return found


def _remove_partial_files(tmp: dict[str, str], builders: dict[str, list]) -> None:
    """Delete everything this run wrote under its temporary names (the parts and the merged files)."""
    for parts in builders.values():
        for builder in parts:
            builder.abort()
    for t in tmp.values():
        for path in glob.glob(glob.escape(t) + "*"):
            os.remove(path)


def _convert(args: PreprocessArgs, files: list[str], workers: int, prefixes: dict[str, str], tmp: dict[str, str],
             builders: dict[str, list], dtype, progress: bool) -> dict[str, int]:
    counts = {"documents": 0, "empty_documents": 0, "bad_lines": 0, "tokens": 0}
    jobs = ((p, n, raw, args.json_keys, args.split_sentences, args.append_eod) for p, n, raw in read_lines(files))
    total_bytes = sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress, file=sys.stderr)
    started, done_bytes = time.perf_counter(), 0
    pool = multiprocessing.Pool(workers, _init_worker, (args.tokenizer,)) if workers > 1 else None
    feed = _BoundedFeed(jobs, window=1024 * workers)
    try:
        if pool is None:
            _init_worker(args.tokenizer)
        results = pool.imap(encode_line, feed, chunksize=32) if pool else map(encode_line, feed)
        for line_index, (path, number, size, result) in enumerate(results):
            feed.done_one()
            done_bytes += size
            bar.update(size)
            if isinstance(result, str):
                if not args.skip_bad_lines:
                    raise ConfigError(f"{path}:{number}: {result}; fix the line or pass --skip-bad-lines")
                counts["bad_lines"] += 1
                continue
            part = line_index % args.partitions
            for key, sentences in result.items():
                # A text that tokenizes to nothing stays a document with no sequences, as Megatron's
                # preprocess_data.py keeps it (document_indices repeats the previous entry).
                counts["empty_documents"] += not sentences
                ids = np.concatenate(sentences) if sentences else np.zeros(0, dtype=np.int32)
                counts["tokens"] += ids.size
                builders[key][part].add_document(ids, [len(s) for s in sentences])
            counts["documents"] += 1
            if line_index % 1000 == 0:
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix(docs_s=f"{counts['documents'] / elapsed:.0f}", MB_s=f"{done_bytes / elapsed / 1e6:.1f}")
    finally:
        feed.stop()
        bar.close()
        if pool is not None:
            pool.terminate()
    for key, parts in builders.items():
        for builder in parts:
            builder.finalize(builder.bin_file[:-4] + ".idx")
        merged = IndexedDatasetBuilder(tmp[key] + ".bin", dtype)
        for builder in parts:
            merged.add_index(builder.bin_file[:-4])
            os.remove(builder.bin_file)
            os.remove(builder.bin_file[:-4] + ".idx")
        merged.finalize(tmp[key] + ".idx")
        os.replace(tmp[key] + ".bin", prefixes[key] + ".bin")
        os.replace(tmp[key] + ".idx", prefixes[key] + ".idx")
    counts["seconds"] = time.perf_counter() - started
    counts["megabytes"] = done_bytes / 1e6
    return counts


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = tyro.cli(PreprocessArgs, args=argv, prog="python -m lmfunc.data.preprocess")
    try:
        counts = preprocess(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted: the partial output files were removed", file=sys.stderr)
        raise SystemExit(130) from None
    rate = counts["megabytes"] / max(counts["seconds"], 1e-9)
    print(f"{counts['documents']} documents ({counts['empty_documents']} empty, kept as Megatron does; "
          f"{counts['bad_lines']} bad lines skipped), {counts['megabytes']:.1f} MB in {counts['seconds']:.1f} s ({rate:.1f} MB/s) -> "
          + ", ".join(p + ".{bin,idx}" for p in output_prefixes(args).values()))
    if counts["tokens"] == 0:
        print(f"warning: {args.input} gave no tokens ({counts['documents']} documents, {counts['bad_lines']} bad lines): "
              "the dataset written is empty and cannot be trained on; check the input and --json-keys", file=sys.stderr)


if __name__ == "__main__":
    main()
