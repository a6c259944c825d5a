import pytest
import torch

from lmfunc import model
from lmfunc.checkpoint import load_weights, save_weights
from lmfunc.config import model_preset
from lmfunc.generate import generate, sample_next
from lmfunc.model.kv_cache import forward_cached, init_cache
from lmfunc.tree import tree_allclose

FEATURES = [
    {},
    {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "activation": "gelu",
     "add_bias_linear": True, "qk_layernorm": True, "tie_embeddings": False},
    {"num_query_groups": 1, "rotary_percent": 0.5},
]


def greedy_by_recomputing(params, cfg, prompt, new_tokens):
    tokens = prompt
    for _ in range(new_tokens):
        next_token = model.logits(params, model.forward(params, tokens, cfg), cfg)[:, -1].argmax(-1)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
    return tokens


@pytest.mark.parametrize("features", FEATURES)
def test_cached_greedy_equals_recomputing_the_full_forward(features):
    cfg = model_preset("tiny", init_method_std=0.5, **features)
    params = model.init(cfg, seed=1, dtype=torch.float64)
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    out = generate(params, cfg, prompt, 24, temperature=0.0)
    assert out.shape == (2, 29)
    assert torch.equal(out, greedy_by_recomputing(params, cfg, prompt, 24))


def test_cached_hidden_states_equal_the_full_forward_chunk_by_chunk():
    cfg = model_preset("tiny")
    params = model.init(cfg, seed=0, dtype=torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    full = model.forward(params, tokens, cfg)
    cache = init_cache(cfg, batch=2, max_seq_len=16, dtype=torch.float64)
    pieces = []
    for chunk in (tokens[:, :5], tokens[:, 5:6], tokens[:, 6:]):
        hidden, cache = forward_cached(params, chunk, cfg, cache)
        pieces.append(hidden)
    assert int(cache["length"]) == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)


def test_the_cache_never_overflows_silently():
    cfg = model_preset("tiny")  # max_position_embeddings 64
    params = model.init(cfg, seed=0)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(60\) = 70 exceeds the KV cache's max_seq_len \(64\)"):
        generate(params, cfg, list(range(10)), 60)
    cache = init_cache(cfg, batch=1, max_seq_len=8)
    _, cache = forward_cached(params, torch.zeros(1, 6, dtype=torch.long), cfg, cache)
    with pytest.raises(ValueError, match=r"KV cache overflow: 6 cached \+ 3 new positions exceed its max_seq_len of 8"):
        forward_cached(params, torch.zeros(1, 3, dtype=torch.long), cfg, cache)


def test_sampling_is_seeded_and_filters_respect_top_k_and_top_p():
    cfg = model_preset("tiny")
    params = model.init(cfg, seed=0)
    a = generate(params, cfg, [1, 2, 3], 20, temperature=1.0, seed=7)
    assert torch.equal(a, generate(params, cfg, [1, 2, 3], 20, temperature=1.0, seed=7))
    assert not torch.equal(a, generate(params, cfg, [1, 2, 3], 20, temperature=1.0, seed=8))
    assert torch.equal(generate(params, cfg, [1, 2, 3], 10, top_k=1, seed=3), generate(params, cfg, [1, 2, 3], 10, temperature=0.0))
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    top2 = {int(sample_next(logits, top_k=2, generator=g)) for _ in range(200)}
    nucleus = {int(sample_next(logits, top_p=0.8, generator=g)) for _ in range(200)}
    assert top2 == {0, 1} and nucleus == {0, 1}
    assert {int(sample_next(logits, top_p=0.81, generator=g)) for _ in range(400)} == {0, 1, 2}
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(params, cfg, [1], 2, top_p=1.5)


def test_weights_round_trip_and_mismatches_are_named(tmp_path):
    cfg = model_preset("tiny")
    params = model.init(cfg, seed=0)
    path = str(tmp_path / "model.safetensors")
    save_weights(params, path)
    assert tree_allclose(load_weights(path, model.param_shapes(cfg)), params, rtol=0, atol=0)
    wider = model_preset("tiny", ffn_hidden_size=256, tie_embeddings=False)
    with pytest.raises(ValueError, match=r"missing: \['output'\].*wrong shapes: \['layers.0.mlp.w_gate \(64, 128\) \(model expects \(64, 256\)\)"):
        load_weights(path, model.param_shapes(wider))
