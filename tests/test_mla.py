"""Multi-head latent attention: the attention against DeepSeek's formulas written out here (fp64),
the parameter count against Megatron's formula, generation from a cache of latents, its bytes per
token against grouped-query attention, and the deepseek-v3-tiny preset through the trainer."""

import dataclasses
import math
import os

import pytest
import torch

from lmfunc import model
from lmfunc.config import ConfigError, ModelConfig, model_preset
from lmfunc.config.parallel import ParallelConfig
from lmfunc.config.train import DataConfig, TrainConfig
from lmfunc.model import layers, mla
from lmfunc.model.kv_cache import forward_cached, init_cache
from lmfunc.plan.megatron import MegatronArgs, megatron_report
from lmfunc.train.__main__ import main as train_main
from lmfunc.train.log import read_log
from lmfunc.tree import flatten_with_paths

MLA = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=32,
                  multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6,
                  qk_pos_emb_head_dim=4, v_head_dim=5)


def rms(x, scale, eps=1e-5):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def rotate(x, positions, base=10000.0):
    """RoPE on the last dim of ``x`` ``[S, ..., r]`` at ``positions`` (half-split pairs)."""
    r = x.shape[-1]
    freq = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = positions.double()[:, None] * freq
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    cos, sin = cos.view(-1, *[1] * (x.dim() - 2), r), sin.view(-1, *[1] * (x.dim() - 2), r)
    first, second = x[..., : r // 2], x[..., r // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_latent_attention_follows_deepseeks_formulas(q_lora_rank):
    cfg = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    p = model.init(cfg, seed=1, dtype=torch.float64)["layers"]["0"]["attn"]
    x = torch.randn(1, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(7)
    got = layers.attention(p, x, cfg, layers.rope_tables(positions, cfg), None, project=mla.project_qkv)[0]

    a, nope, rope_dim, dv = 4, 6, 4, 5
    h = x[0]
    if q_lora_rank is None:
        q = h @ p["wq"]
    else:
        q = rms(h @ p["wq_down"], p["q_norm"]["scale"]) @ p["wq_up"]
    q = q.view(7, a, nope + rope_dim)
    q = torch.cat([q[..., :nope], rotate(q[..., nope:], positions)], -1)
    compressed = h @ p["wkv_down"]
    latent, k_rope = rms(compressed[:, :10], p["kv_norm"]["scale"]), rotate(compressed[:, 10:], positions)
    kv = (latent @ p["wkv_up"]).view(7, a, nope + dv)
    k = torch.cat([kv[..., :nope], k_rope[:, None, :].expand(7, a, rope_dim)], -1)
    v = kv[..., nope:]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(nope + rope_dim)
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    heads = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    expected = heads.reshape(7, a * dv) @ p["wo"]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_the_parameters_are_megatrons_count():
    """deepseek-v3-tiny's leaves against Megatron's formula, which leaves out the expert biases
    (buffers) and each MTP depth's projection and norms."""
    cfg = model_preset("deepseek-v3-tiny")
    shapes = dict(flatten_with_paths(model.param_shapes(cfg)))
    counted = sum(t.numel() for name, t in shapes.items()
                  if not name.endswith("expert_bias") and not (name.startswith("mtp.") and ".layer." not in name))
    megatron = megatron_report(MegatronArgs.from_config(TrainConfig(model=cfg).validate(1), 1)).counts
    assert counted == megatron.total
    h, a = 256, 4
    assert shapes["layers.0.attn.wkv_down"].shape == (h, 64 + 16)
    assert shapes["layers.0.attn.wq_up"].shape == (96, a * (32 + 16))
    assert shapes["layers.0.attn.wkv_up"].shape == (64, a * (32 + 32))
    assert shapes["layers.0.attn.wo"].shape == (a * 32, h)
    axes = dict(flatten_with_paths(model.param_axes(cfg)))
    assert axes["layers.0.attn.wkv_down"] == ("embed", "kv_lora") and axes["layers.0.attn.wkv_up"] == ("kv_lora", "heads")


def test_generation_caches_latents_and_gives_the_forward_logits():
    cfg = dataclasses.replace(model_preset("deepseek-v3-tiny"), mtp_num_layers=0, num_layers=2, moe_layer_freq=(0, 1))
    params = model.init(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    full = model.logits(params, model.forward(params, ids, cfg), cfg)
    cache = init_cache(cfg, 2, 16)
    assert set(cache["layers"]["0"]) == {"latent", "rope_key"}
    per_token = sum(t[0, :1].numel() for entry in cache["layers"].values() for t in entry.values())
    assert per_token == 2 * mla.cache_values_per_token(cfg) == 2 * (64 + 16)
    hidden, cache = forward_cached(params, ids[:, :5], cfg, cache)
    outputs = [hidden]
    for t in range(5, 12):
        hidden, cache = forward_cached(params, ids[:, t:t + 1], cfg, cache)
        outputs.append(hidden)
    torch.testing.assert_close(model.logits(params, torch.cat(outputs, 1), cfg), full, rtol=1e-5, atol=1e-5)


def test_the_latent_cache_is_smaller_than_grouped_query_attention():
    mha = model_preset("llama-1b")  # 32 query heads, 8 groups of 64
    latent = dataclasses.replace(mha, multi_latent_attention=True, kv_lora_rank=512, qk_pos_emb_head_dim=64)
    assert mla.cache_values_per_token(mha) == 2 * 8 * 64 == 1024
    assert mla.cache_values_per_token(latent) == 576
    assert mla.cache_values_per_token(dataclasses.replace(mha, num_query_groups=None)) == 4096


@pytest.mark.parametrize("change, message", [
    (dict(qk_pos_emb_head_dim=5), "qk_pos_emb_head_dim must be even"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be a positive integer"),
    (dict(q_lora_rank=0), "q_lora_rank must be positive"),
])
def test_bad_mla_settings_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(MLA, **change)


def test_mla_settings_lmfunc_cannot_build_are_refused_by_name():
    with pytest.raises(ConfigError, match="qk_layernorm with MLA"):
        model.init(dataclasses.replace(MLA, qk_layernorm=True))
    with pytest.raises(ConfigError, match=r"model\.qk_layernorm with MLA .*: not implemented in this version of lmfunc"):
        TrainConfig(model=dataclasses.replace(MLA, qk_layernorm=True), parallel=ParallelConfig(cp=2)).validate(2)
    TrainConfig(model=MLA, parallel=ParallelConfig(cp=2), data=DataConfig(seq_length=32)).validate(2)


def test_the_deepseek_preset_trains(tmp_path):
    train_main(["--preset", "deepseek-v3-tiny", "--data.seq-length", "32", "--run.micro-batch-size", "2",
                "--run.global-batch-size", "4", "--log.no-progress-bar", "--run.no-compile",
                "--optim.lr-warmup-iters", "1", "--run.eval-iters", "1", "--run.sample-tokens", "4",
                "--log.peak-flops", "1e11", "--log.log-interval", "1", "--run.train-iters", "3",
                "--run.out-dir", str(tmp_path), "--run.name", "ds"])
    records = [r for r in read_log(os.path.join(tmp_path, "ds", "log.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    last = records[-1]
    assert math.isfinite(last["loss"]) and "mtp_1_loss" in last and "moe_seq_aux_loss" in last
    assert "moe_seq_aux_loss/mtp.0.layer.mlp" in last
