import dataclasses

import pytest
import torch

from lmfunc import model, value_and_grad
from lmfunc.config import MODEL_PRESETS, ConfigError, ModelConfig, model_preset
from lmfunc.loss import lm_loss_sum
from lmfunc.model import layers
from lmfunc.tree import flatten_with_paths, tree_map, tree_map_with_path

TINY = model_preset("tiny")
# Every optional feature switched the other way from TINY.
GPT2_STYLE = dataclasses.replace(
    TINY, position_embedding_type="learned_absolute", normalization="LayerNorm", activation="gelu",
    add_bias_linear=True, tie_embeddings=False, qk_layernorm=True, num_query_groups=None,
)
PARTIAL_ROPE = dataclasses.replace(TINY, rotary_percent=0.5, qk_layernorm=True, num_query_groups=1)


def run_logits(cfg, params, tokens, **kw):
    return model.logits(params, model.forward(params, tokens, cfg, **kw), cfg)


@pytest.mark.parametrize("cfg", [TINY, GPT2_STYLE], ids=["llama", "gpt2"])
def test_causality(cfg):
    params = model.init(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    t = 9
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    before, after = run_logits(cfg, params, tokens), run_logits(cfg, params, changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
    assert (before[:, t:] - after[:, t:]).abs().amax(-1).min() > 1e-6


@pytest.mark.parametrize("cfg", [TINY, GPT2_STYLE], ids=["llama", "gpt2"])
def test_document_mask_blocks_attention_across_documents(cfg):
    params = model.init(cfg, seed=2)
    doc_a, doc_b = torch.randint(0, cfg.vocab_size, (1, 5)), torch.randint(0, cfg.vocab_size, (1, 7))
    tokens = torch.cat([doc_a, doc_b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.tensor([list(range(5)) + list(range(7))])
    packed = run_logits(cfg, params, tokens, positions=positions, doc_ids=doc_ids)
    alone = run_logits(cfg, params, doc_b)
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)
    unmasked = run_logits(cfg, params, tokens, positions=positions)
    assert (unmasked[:, 5:] - alone).abs().max() > 1e-4


def test_rope_scores_depend_only_on_relative_position():
    cfg = TINY
    q, k = torch.randn(1, 12, 1, cfg.head_dim), torch.randn(1, 12, 1, cfg.head_dim)
    positions = torch.arange(12)

    def scores(offset):
        cos, sin = layers.rope_tables(positions + offset, cfg)
        return torch.einsum("bsd,btd->st", layers.apply_rope(q, cos, sin)[:, :, 0], layers.apply_rope(k, cos, sin)[:, :, 0])

    torch.testing.assert_close(scores(0), scores(37), rtol=1e-4, atol=1e-4)
    assert (scores(0) - torch.einsum("bsd,btd->st", q[:, :, 0], k[:, :, 0])).abs().max() > 1e-3


def test_rope_model_is_shift_invariant_and_learned_positions_are_not():
    tokens = torch.randint(0, TINY.vocab_size, (2, 10))
    shifted = torch.arange(10) + 20
    params = model.init(TINY, seed=3)
    torch.testing.assert_close(
        run_logits(TINY, params, tokens), run_logits(TINY, params, tokens, positions=shifted), rtol=1e-4, atol=1e-4
    )
    gpt2 = model.init(GPT2_STYLE, seed=3)
    assert (run_logits(GPT2_STYLE, gpt2, tokens) - run_logits(GPT2_STYLE, gpt2, tokens, positions=shifted)).abs().max() > 1e-4


def test_partial_rotary_and_interpolation():
    x = torch.randn(2, 6, 3, PARTIAL_ROPE.head_dim)
    cos, sin = layers.rope_tables(torch.arange(6), PARTIAL_ROPE)
    assert cos.shape[-1] == PARTIAL_ROPE.head_dim // 2
    out = layers.apply_rope(x, cos, sin)
    torch.testing.assert_close(out[..., PARTIAL_ROPE.head_dim // 2 :], x[..., PARTIAL_ROPE.head_dim // 2 :])
    assert (out[:, 1:, :, : PARTIAL_ROPE.head_dim // 2] - x[:, 1:, :, : PARTIAL_ROPE.head_dim // 2]).abs().max() > 1e-3
    interpolated = dataclasses.replace(TINY, seq_len_interpolation_factor=2.0)
    torch.testing.assert_close(layers.rope_tables(torch.arange(0, 20, 2), interpolated), layers.rope_tables(torch.arange(10), TINY))


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_params = model.init(TINY, seed=4)
    mha_cfg = dataclasses.replace(TINY, num_query_groups=None)
    repeat = TINY.num_attention_heads // TINY.query_groups
    h, d = TINY.hidden_size, TINY.head_dim

    def expand(name, leaf):
        if name.endswith(("attn.wk", "attn.wv")):
            return leaf.view(h, TINY.query_groups, d).repeat_interleave(repeat, dim=1).reshape(h, -1)
        return leaf

    mha_params = tree_map_with_path(expand, gqa_params)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    torch.testing.assert_close(run_logits(TINY, gqa_params, tokens), run_logits(mha_cfg, mha_params, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [TINY, GPT2_STYLE, PARTIAL_ROPE], ids=["llama", "gpt2", "partial-rope-mqa"])
def test_gradients_match_finite_differences(cfg):
    cfg = dataclasses.replace(cfg, num_layers=1, hidden_size=32, ffn_hidden_size=48, vocab_size=40)
    params = model.init(cfg, seed=5, dtype=torch.float64)
    params = tree_map(lambda p: p + 0.1 * torch.randn_like(p), params)  # move norms/biases off their init
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "doc_ids": torch.tensor([[0] * 4 + [1] * 4] * 2)}

    def mean_loss(p):
        total, count = lm_loss_sum(p, batch, cfg)
        return total / count

    _, grads = value_and_grad(mean_loss)(params)
    eps = 1e-6
    for trial in range(3):
        direction = tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)
        plus = mean_loss(tree_map(lambda p, v: p + eps * v, params, direction))
        minus = mean_loss(tree_map(lambda p, v: p - eps * v, params, direction))
        numeric = (plus - minus) / (2 * eps)
        analytic = sum((gr * v).sum() for gr, v in zip(torch.utils._pytree.tree_leaves(grads), torch.utils._pytree.tree_leaves(direction)))
        assert abs(float(numeric - analytic)) <= 1e-7 * max(1.0, abs(float(analytic))), (trial, float(numeric), float(analytic))
    for name, grad in flatten_with_paths(grads):
        assert grad.abs().max() > 0, f"{name} got no gradient"


def test_init_follows_megatron():
    cfg = model_preset("small")
    params = model.init(cfg, seed=0)
    layer = params["layers"]["0"]
    assert abs(float(layer["attn"]["wq"].std()) - cfg.init_method_std) < 5e-4
    scaled = cfg.init_method_std / (2 * cfg.num_layers) ** 0.5
    assert abs(float(layer["attn"]["wo"].std()) - scaled) < 2e-4
    assert abs(float(layer["mlp"]["w_out"].std()) - scaled) < 2e-4
    assert torch.equal(layer["attn_norm"]["scale"], torch.ones(cfg.hidden_size))
    deeper = model.init(dataclasses.replace(cfg, num_layers=6), seed=0)
    assert torch.equal(deeper["layers"]["0"]["attn"]["wq"], layer["attn"]["wq"])
    assert not torch.equal(model.init(cfg, seed=1)["layers"]["0"]["attn"]["wq"], layer["attn"]["wq"])


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_param_axes_line_up_with_shapes(name):
    cfg = model_preset(name)
    shapes = dict(flatten_with_paths(model.param_shapes(cfg)))
    axes = dict(flatten_with_paths(model.param_axes(cfg)))
    assert shapes.keys() == axes.keys()
    assert all(len(axes[k]) == shapes[k].dim() for k in shapes)
    assert axes["embed.tokens"] == ("vocab", "embed")
    if not cfg.multi_latent_attention or cfg.q_lora_rank is None:
        assert axes["layers.0.attn.wq"] == ("embed", "heads")
    assert axes["layers.0.attn.wo"] == ("heads", "embed")


def test_dropout_is_a_pure_function_of_the_seed():
    cfg = dataclasses.replace(TINY, hidden_dropout=0.2, attention_dropout=0.1)
    params = model.init(cfg, seed=6)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    seed = torch.tensor(11)
    a, b = model.forward(params, tokens, cfg, dropout_seed=seed), model.forward(params, tokens, cfg, dropout_seed=seed)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - model.forward(params, tokens, cfg, dropout_seed=torch.tensor(12))).abs().max() > 1e-3
    assert (a - model.forward(params, tokens, cfg)).abs().max() > 1e-3
    no_dropout = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    torch.testing.assert_close(model.forward(params, tokens, cfg), model.forward(params, tokens, no_dropout, dropout_seed=seed))
    x = torch.ones(200_000)
    dropped = layers.dropout(x, 0.3, seed, stream=5)
    assert abs(float((dropped == 0).float().mean()) - 0.3) < 0.01
    torch.testing.assert_close(dropped.mean(), torch.tensor(1.0), rtol=0.02, atol=0)


def test_config_errors_name_the_fields():
    with pytest.raises(ConfigError, match="hidden_size.*num_attention_heads"):
        ModelConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ConfigError, match="num_query_groups"):
        ModelConfig(num_attention_heads=4, num_query_groups=3)
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        model_preset("tiyn")


def test_bad_inputs_are_clear_errors():
    params = model.init(GPT2_STYLE, seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.forward(params, torch.zeros(1, GPT2_STYLE.max_position_embeddings + 1, dtype=torch.long), GPT2_STYLE)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model.forward(params, torch.zeros(5, dtype=torch.long), GPT2_STYLE)
