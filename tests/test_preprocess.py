import json
import struct
import os

import numpy as np
import pytest

from lmfunc.config import ConfigError
from lmfunc.data.indexed import IndexedDataset
from lmfunc.data.merge import main as merge_main
from lmfunc.data.preprocess import PreprocessArgs, main, preprocess, split_sentences
from lmfunc.data.tokenizer import ByteTokenizer

DOCS = ["The first document. It has two sentences!", "Second: Dr. Smith met Mr. Jones. Then they left.",
        "ünïcode ✓ third", "Fourth one.", "Fifth and last? Yes."]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def run(tmp_path, records, **kw):
    source = write_jsonl(tmp_path / "in.jsonl", records)
    args = PreprocessArgs(input=source, output_prefix=str(tmp_path / "out"), **kw)
    return preprocess(args, progress=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip_reproduces_every_document(tmp_path, workers):
    counts = run(tmp_path, [{"text": d, "title": d[:5]} for d in DOCS], json_keys=("text", "title"),
                 append_eod=True, workers=workers)
    assert counts["documents"] == 5
    tok = ByteTokenizer()
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16 and ds.num_documents == 5
    for i, doc in enumerate(DOCS):
        assert ds.document(i).tolist() == tok.encode(doc) + [tok.eod]
    titles = IndexedDataset(str(tmp_path / "out_title_document"))
    assert [tok.decode(titles.document(i)) for i in range(5)] == [d[:5] for d in DOCS]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_partitions_give_megatrons_document_order(tmp_path):
    run(tmp_path, [{"text": d} for d in DOCS], partitions=2)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = ByteTokenizer()
    assert [tok.decode(ds.document(i)) for i in range(5)] == [DOCS[i] for i in (0, 2, 4, 1, 3)]


def test_sentence_split(tmp_path):
    assert split_sentences(DOCS[1]) == ["Second: Dr. Smith met Mr. Jones.", "Then they left."]
    assert split_sentences('He said "stop." Then left. e.g. this stays. J. R. R. Tolkien wrote.') == [
        'He said "stop."', "Then left. e.g. this stays.", "J. R. R. Tolkien wrote."]
    run(tmp_path, [{"text": d} for d in DOCS], split_sentences=True, append_eod=True)
    ds = IndexedDataset(str(tmp_path / "out_text_sentence"))
    assert ds.num_documents == 5 and len(ds) == 8
    tok = ByteTokenizer()
    assert tok.decode(ds[0]) == "The first document." and ds[1].tolist()[-1] == tok.eod


def test_bad_lines_are_named_or_skipped_and_counted(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "good"}\n{"text": broken\n{"other": 1}\n{"text": "   "}\n'
                       b'{"text": "\xff\xfe bad utf8"}\n' + json.dumps({"text": "x" * 2_000_000}).encode() + b"\n")
    args = PreprocessArgs(input=str(source), output_prefix=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"in\.jsonl:2: malformed JSON .*--skip-bad-lines"):
        preprocess(args, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]  # nothing partial left behind
    counts = preprocess(PreprocessArgs(input=str(source), output_prefix=str(tmp_path / "out"), skip_bad_lines=True),
                        progress=False)
    assert (counts["documents"], counts["bad_lines"], counts["empty_documents"]) == (3, 3, 0)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.num_documents == 3 and len(ds[1]) == 3 and len(ds[2]) == 2_000_000  # "   " is 3 byte tokens


def test_an_empty_text_stays_a_document_without_sequences_as_in_megatron(tmp_path):
    """Megatron's preprocess_data.py calls add_document with no ids for a text that tokenizes to
    nothing: document_indices repeats the previous entry. The .idx bytes, written out by hand."""
    counts = run(tmp_path, [{"text": "ab"}, {"text": ""}, {"text": ["", "c"]}, {"text": []}, {"text": "de"}])
    assert (counts["documents"], counts["empty_documents"]) == (5, 2)
    lengths, documents = [2, 1, 2], [0, 1, 1, 2, 2, 3]
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(documents))
                + np.array(lengths, "<i4").tobytes() + np.array([0, 4, 6], "<i8").tobytes()
                + np.array(documents, "<i8").tobytes())
    assert (tmp_path / "out_text_document.idx").read_bytes() == expected
    assert (tmp_path / "out_text_document.bin").read_bytes() == np.array(list(b"abcde"), "<u2").tobytes()


def test_missing_key_and_utf8_messages(tmp_path):
    with pytest.raises(ConfigError, match=r"in\.jsonl:1: missing json key 'text'"):
        run(tmp_path, [{"body": "x"}])
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"in\.jsonl:1: invalid UTF-8 at byte 10"):
        preprocess(PreprocessArgs(input=str(tmp_path / "in.jsonl"), output_prefix=str(tmp_path / "o")), progress=False)
    with pytest.raises(ConfigError, match="names no file"):
        preprocess(PreprocessArgs(input=str(tmp_path / "none*.jsonl"), output_prefix="o"), progress=False)


def test_cli_and_merge(tmp_path, capsys):
    for name, docs in (("a", DOCS[:2]), ("b", DOCS[2:])):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])
        main(["--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name), "--append-eod"])
    assert "2 documents" in capsys.readouterr().out
    merge_main(["--input", str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document"),
                "--output-prefix", str(tmp_path / "ab")])
    merged = IndexedDataset(str(tmp_path / "ab"))
    tok = ByteTokenizer()
    assert [tok.decode(merged.document(i)) for i in range(5)] == DOCS
    main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "dir")])  # a directory of .jsonl files
    assert IndexedDataset(str(tmp_path / "dir_text_document")).num_documents == 5


def test_data_benchmark_runs(capsys):
    from experiments.bench.data import DataBenchConfig, main as bench_main

    bench_main(DataBenchConfig(megabytes=0.3, workers=(1,), repeats=1, batches=5, seq_length=32))
    out = capsys.readouterr().out
    assert "preprocess workers=1:" in out and "samples/s" in out


@pytest.mark.slow
def test_a_100_megabyte_single_line(tmp_path):
    """One JSON line of 100 MB is streamed through without a per-token Python list."""
    source = tmp_path / "huge.jsonl"
    with open(source, "w") as f:
        f.write('{"text": "')
        chunk = "abcdefghij" * 100_000  # 1 MB
        for _ in range(100):
            f.write(chunk)
        f.write('"}\n{"text": "small"}\n')
    counts = preprocess(PreprocessArgs(input=str(source), output_prefix=str(tmp_path / "out"), append_eod=True),
                        progress=False)
    assert counts["documents"] == 2
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.sequence_lengths.tolist() == [100_000_001, 6]
    assert bytes(ds.get(0, 99_999_990, 10).astype(np.uint8)) == b"abcdefghij" and ds[0][-1] == 256
