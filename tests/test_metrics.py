import dataclasses

import pytest

from experiments.bench.config import BenchConfig
from experiments.bench.train_step import run_worker
from lmfunc.config import ModelConfig
from lmfunc.plan.megatron import flops_per_token, mfu


def test_flops_match_megatrons_worked_example():
    """megatron.md section 7: preset tiny (L=2, h=64, a=4, LayerNorm, GeLU, V=384, s=128) prints
    835,584 FLOPs per token and 855,638,016 per 8x128-token iteration."""
    cfg = ModelConfig(
        vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
        normalization="LayerNorm", activation="gelu", max_position_embeddings=128,
    )
    assert flops_per_token(cfg, 128) == 835_584
    assert flops_per_token(cfg, 128) * 8 * 128 == 855_638_016
    assert mfu(1000.0, cfg, 128, 835_584_000.0) == pytest.approx(1.0)


def test_swiglu_and_gqa_terms():
    base = ModelConfig(vocab_size=100, hidden_size=64, num_layers=1, num_attention_heads=4, ffn_hidden_size=96)
    gelu = dataclasses.replace(base, activation="gelu")
    assert flops_per_token(base, 8) - flops_per_token(gelu, 8) == 6 * 64 * 96
    gqa = dataclasses.replace(base, num_query_groups=1)
    assert flops_per_token(base, 8) - flops_per_token(gqa, 8) == 6 * 64 * 2 * 16 * 3


def test_mtp_depths_add_a_layer_a_projection_and_a_head_pass_each():
    cfg = ModelConfig(
        vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
        normalization="LayerNorm", activation="gelu", max_position_embeddings=128,
    )
    layer = (835_584 - 6 * 64 * 384) // 2  # per-layer share of the worked example (attention core included)
    with_mtp = dataclasses.replace(cfg, mtp_num_layers=2)
    assert flops_per_token(with_mtp, 128) == 835_584 + 2 * (layer + 6 * 64 * 384 + 6 * (3 * 64 + 2 * 64 * 64))


def test_bench_baseline_is_the_same_model():
    """The nn.Module baseline must start from the same weights and loss as the functional step."""
    small = dict(layers=1, heads=2, hidden=32, seq=16, vocab=64, batch=2, steps=1, warmup=0)
    functional = run_worker(BenchConfig(worker="func-eager", **small))
    module = run_worker(BenchConfig(worker="module-eager", **small))
    assert functional["first_loss"] == pytest.approx(module["first_loss"], abs=1e-5)
    assert functional["step_s"] > 0 and module["step_s"] > 0


@pytest.mark.parametrize("preset", ["tiny", "small", "gpt2-small", "llama-1b"])
def test_flops_are_six_n_plus_causal_attention(preset):
    """6 x (matmul parameters, output head included) + 6 L q s: the score and value matmuls of
    causal attention counted once (half of 2 x 2 x q x s per token per layer, times 3 for fwd+bwd)."""
    from lmfunc import model
    from lmfunc.config import model_preset
    from lmfunc.tree import flatten_with_paths

    cfg = model_preset(preset)
    shapes = dict(flatten_with_paths(model.param_shapes(cfg)))
    matmul = sum(t.numel() for name, t in shapes.items() if t.dim() == 2 and not name.startswith("embed."))
    matmul += cfg.hidden_size * cfg.vocab_size if cfg.tie_embeddings else 0
    seq = 1024
    q = cfg.num_attention_heads * cfg.head_dim
    assert flops_per_token(cfg, seq) == 6 * matmul + 6 * cfg.num_layers * q * seq
