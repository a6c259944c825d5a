import os

import numpy as np
import pytest
import torch

from lmfunc.config import ConfigError
from lmfunc.data.batch import lm_batch
from lmfunc.data.corpus import embedded_documents, text_file_documents
from lmfunc.data.pipeline import build_datasets, split_ranges
from lmfunc.data.tokenizer import ByteTokenizer, padded_vocab_size


def test_byte_tokenizer_round_trips_utf8_and_pads_like_megatron():
    tok = ByteTokenizer()
    text = "Grüße, λ → ok"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids + [tok.eod, tok.pad]) == text
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    assert padded_vocab_size(258) == 384 and padded_vocab_size(50257) == 50304 and padded_vocab_size(256) == 256
    assert padded_vocab_size(258, 128, tensor_parallel=4) == 512


def test_embedded_corpus_is_real_english_text():
    docs = embedded_documents()
    assert len(docs) > 50 and sum(len(d) for d in docs) > 300_000
    words = " ".join(docs).lower().split()
    assert words.count("the") > 2000  # prose, not code or noise


def test_megatron_split_rule():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("90,10,0", 79) == [(0, 71), (71, 79), None]
    assert split_ranges("1", 10) == [(0, 10), None, None]
    with pytest.raises(ConfigError, match="data.split 'a,b' must be one to three non-negative weights"):
        split_ranges("a,b", 10)


def test_embedded_corpus_is_tokenised_once_and_split_over_sequences(tmp_path):
    from lmfunc.config.train import DataConfig

    tok = ByteTokenizer()
    data = DataConfig(split="90,10,0", seq_length=64)
    sets = build_datasets(data, tok, {"train": 100, "valid": 10}, seed=5, cache_dir=str(tmp_path))
    train, valid = sets["train"], sets["valid"]
    assert sets["test"] is None and len(train) >= 100 and len(valid) >= 10
    assert train.indexed.prefix == valid.indexed.prefix and train.indexed.num_documents == len(embedded_documents())
    assert set(train.document_index.tolist()) == set(range(71)) and set(valid.document_index.tolist()) == set(range(71, 79))
    assert train.indexed.document(0).tolist() == tok.encode(embedded_documents()[0]) + [tok.eod]
    assert train[0].shape == (65,)
    again = build_datasets(data, tok, {"train": 100, "valid": 10}, seed=5, cache_dir=str(tmp_path))
    assert np.array_equal(again["train"][3], train[3])
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".bin")]) == 1


def test_text_file_paragraphs_become_documents(tmp_path):
    from lmfunc.config.train import DataConfig

    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(10)))
    docs = text_file_documents(str(path))
    assert len(docs) == 10
    sets = build_datasets(DataConfig(text_file=str(path), split="8,2,0", seq_length=16), ByteTokenizer(),
                          {"train": 4, "valid": 2}, seed=0, cache_dir=str(tmp_path / "cache"))
    assert sets["valid"].indexed.num_documents == 10 and set(sets["valid"].document_index.tolist()) == {8, 9}
    with pytest.raises(ConfigError, match="data.text_file: .*missing.txt does not exist"):
        text_file_documents(str(tmp_path / "missing.txt"))


def test_lm_batch_follows_megatron_masks_and_positions():
    eod = 9
    samples = np.array([[1, 2, 9, 3, 4, 9, 5, 6, 7]])
    b = lm_batch(samples, eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert b["tokens"].tolist() == [[1, 2, 9, 3, 4, 9, 5, 6]]
    assert b["labels"].tolist() == [[2, 9, 3, 4, 9, 5, 6, 7]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 1, 1]]  # the *input* token is EOD
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]  # the EOD stays in its document
    plain = lm_batch(torch.tensor(samples), eod)
    assert set(plain) == {"tokens", "labels", "loss_mask"} and plain["loss_mask"].sum() == 8
    padded = lm_batch(np.array([[1, 2, 8, 8]]), eod, pad=8)
    assert padded["loss_mask"].tolist() == [[1, 0, 0]]


def test_bpe_tokenizer_trains_locally_and_round_trips(tmp_path, capsys):
    from lmfunc.data.tokenizer import HFTokenizer, load_tokenizer
    from lmfunc.data.train_tokenizer import main as train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    import json
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in embedded_documents()[:20]))
    out = str(tmp_path / "tokenizer.json")
    train_tokenizer(["--input", str(corpus), "--vocab-size", "600", "--output", out])
    assert "600 tokens" in capsys.readouterr().out
    tok = load_tokenizer(out)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 600 and tok.eod == 0
    text = "The assert statement — ünïcode too."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges were learned
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ConfigError, match="unknown tokenizer 'gpt2'"):
        load_tokenizer("gpt2")
    with pytest.raises(ConfigError, match="has no end-of-document token among"):
        HFTokenizer(out, eod_token="<eos>")
    with pytest.raises(SystemExit):
        train_tokenizer(["--input", str(tmp_path / "*.txt"), "--vocab-size", "600", "--output", out])
    assert "matches no file" in capsys.readouterr().err
