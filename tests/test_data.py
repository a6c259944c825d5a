import numpy as np
import pytest
import torch

from lmfunc.config import ConfigError
from lmfunc.data.batch import lm_batch
from lmfunc.data.corpus import embedded_documents, text_file_documents
from lmfunc.data.text_dataset import TextDataset, build_splits, split_ranges, token_stream
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
    with pytest.raises(ConfigError, match="data.split 'a,b'"):
        split_ranges("a,b", 10)


def test_samples_overlap_by_one_token_and_each_epoch_is_a_reshuffled_cover():
    stream = np.arange(1001, dtype=np.int32)
    ds = TextDataset(stream, seq_length=10, seed=3)
    assert len(ds) == 100
    epoch0, epoch1 = ds.samples(0, 100), ds.samples(100, 100)
    starts0, starts1 = sorted(epoch0[:, 0]), sorted(epoch1[:, 0])
    assert starts0 == starts1 == list(range(0, 1000, 10))
    assert np.all(epoch0[:, -1] == epoch0[:, 0] + 10)  # S+1 tokens: the last one starts the next sample
    assert not np.array_equal(epoch0[:, 0], epoch1[:, 0])
    np.testing.assert_array_equal(ds.samples(37, 5), epoch0[37:42])  # resumes from any consumed count
    np.testing.assert_array_equal(TextDataset(stream, 10, seed=3).samples(0, 100), epoch0)


def test_too_short_split_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"the valid split holds 5 tokens, fewer than data.seq_length \+ 1 = 11"):
        TextDataset(np.arange(5, dtype=np.int32), 10, 0, "valid")


def test_splits_follow_documents_and_end_each_with_eod(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(10)))
    docs = text_file_documents(str(path))
    tok = ByteTokenizer()
    splits = build_splits(docs, tok, "8,2,0", seq_length=16, seed=0)
    assert splits["test"] is None
    assert np.count_nonzero(splits["train"].stream == tok.eod) == 8
    assert np.count_nonzero(splits["valid"].stream == tok.eod) == 2
    np.testing.assert_array_equal(splits["valid"].stream, token_stream(docs[8:], tok))
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
