"""``python -m experiments.bench.data``: data pipeline throughput — preprocess MB/s and loader samples/s.

Workload: the embedded corpus (Python reference topics) written as JSON lines and repeated to
``--megabytes`` MB, preprocessed with the byte tokenizer (or a locally trained BPE) and ``--append-eod`` at each worker count
(runs alternated, medians reported); then a ``GPTDataset`` over the result read as the training
loop reads it (``micro_batch_size`` samples of ``seq_length + 1`` tokens, stacked and masked).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time

import numpy as np
import tyro


@dataclasses.dataclass(frozen=True)
class DataBenchConfig:
    """Workload and measurement settings."""

    tokenizer: str = "byte"
    """'byte', 'bpe' (a 4096-token byte-level BPE trained on the corpus first) or a tokenizer.json path."""
    megabytes: float = 20.0
    """Size of the generated JSON-lines input."""
    workers: tuple[int, ...] = (1, 2)
    """Preprocess worker counts to compare."""
    repeats: int = 3
    """Preprocess runs per worker count (alternated)."""
    seq_length: int = 256
    micro_batch_size: int = 8
    batches: int = 200
    """Loader batches to time."""


def write_corpus(path: str, megabytes: float) -> int:
    """Write the embedded corpus as JSON lines, repeated until ``megabytes``; returns the bytes written."""
    from lmfunc.data.corpus import embedded_documents

    lines = [json.dumps({"text": d}) + "\n" for d in embedded_documents()]
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            for line in lines:
                f.write(line)
                written += len(line.encode())
    return written


def main(bc: DataBenchConfig) -> None:
    from lmfunc.data.batch import lm_batch
    from lmfunc.data.gpt_dataset import GPTDataset
    from lmfunc.data.indexed import IndexedDataset
    from lmfunc.data.preprocess import PreprocessArgs, preprocess
    from lmfunc.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "corpus.jsonl")
        size = write_corpus(source, bc.megabytes)
        spec = bc.tokenizer
        if spec == "bpe":
            from lmfunc.data.corpus import embedded_documents
            from lmfunc.data.tokenizer import train_byte_level_bpe

            spec = os.path.join(tmp, "tokenizer.json")
            train_byte_level_bpe(embedded_documents(), 4096).save(spec)
        print(f"input: {size / 1e6:.1f} MB of JSON lines (embedded corpus repeated), tokenizer {bc.tokenizer}, --append-eod")
        rates: dict[int, list[float]] = {w: [] for w in bc.workers}
        for _ in range(bc.repeats):
            for workers in bc.workers:
                args = PreprocessArgs(input=source, output_prefix=os.path.join(tmp, f"w{workers}"), append_eod=True,
                                      workers=workers, tokenizer=spec)
                counts = preprocess(args, progress=False)
                rates[workers].append(counts["megabytes"] / counts["seconds"])
        for workers, values in rates.items():
            print(f"preprocess workers={workers}: {statistics.median(values):.2f} MB/s "
                  f"(runs: {', '.join(f'{v:.2f}' for v in values)})")

        indexed = IndexedDataset(os.path.join(tmp, f"w{bc.workers[0]}_text_document"))
        needed = bc.batches * bc.micro_batch_size
        dataset = GPTDataset(indexed, np.arange(len(indexed), dtype=np.int32), needed, bc.seq_length, seed=1234)
        tokenizer = load_tokenizer(spec)
        start = time.perf_counter()
        for b in range(bc.batches):
            samples = np.stack([dataset[b * bc.micro_batch_size + i] for i in range(bc.micro_batch_size)])
            lm_batch(samples[None], tokenizer.eod)
        seconds = time.perf_counter() - start
        print(f"loader: {needed / seconds:,.0f} samples/s, {1e3 * seconds / bc.batches:.2f} ms per batch of "
              f"{bc.micro_batch_size} x {bc.seq_length + 1} tokens")


if __name__ == "__main__":
    main(tyro.cli(DataBenchConfig, prog="python -m experiments.bench.data"))
