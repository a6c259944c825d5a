"""Incremental decoding with a key/value cache, as pure functions.

The cache is a pytree ``{"layers": {"<i>": {"k", "v"}}, "length"}`` with keys/values
``[B, g, T, d]`` for ``T = max_seq_len`` positions and ``length`` (an int64 scalar) positions
filled. With multi-head latent attention a layer keeps ``{"latent" [B, T, r_kv], "rope_key"
[B, T, 1, d_rope]}`` instead (``lmfunc.model.mla``), and keys and values are expanded from them at
each call. ``forward_cached`` takes the cache and returns a new one; nothing is mutated.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lmfunc.config import ModelConfig
from lmfunc.model import layers, mla, moe
from lmfunc.model.gpt import Params, embed, layer_params

Cache = dict


def init_cache(
    cfg: ModelConfig, batch: int, max_seq_len: Optional[int] = None,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> Cache:
    """An empty cache for ``batch`` sequences of up to ``max_seq_len`` (default
    ``model.max_position_embeddings``) positions."""
    length = cfg.max_position_embeddings if max_seq_len is None else max_seq_len
    if length < 1:
        raise ValueError(f"max_seq_len must be positive, got {length}")
    if cfg.position_embedding_type == "learned_absolute" and length > cfg.max_position_embeddings:
        raise ValueError(
            f"max_seq_len ({length}) exceeds model.max_position_embeddings ({cfg.max_position_embeddings}), "
            "the rows of the learned position table"
        )
    if cfg.multi_latent_attention:
        shapes = {"latent": (batch, length, cfg.kv_lora_rank), "rope_key": (batch, length, 1, cfg.qk_pos_emb_head_dim)}
    else:
        shapes = {"k": (batch, cfg.query_groups, length, cfg.head_dim), "v": (batch, cfg.query_groups, length, cfg.head_dim)}
    return {
        "layers": {str(i): {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes.items()}
                   for i in range(cfg.num_layers)},
        "length": torch.zeros((), dtype=torch.int64, device=device),
    }


def cache_capacity(cache: Cache) -> int:
    """Positions the cache can hold (``T``)."""
    first = cache["layers"]["0"]
    return first["latent"].shape[1] if "latent" in first else first["k"].shape[2]


def forward_cached(params: Params, tokens: torch.Tensor, cfg: ModelConfig, cache: Cache) -> tuple[torch.Tensor, Cache]:
    """Final-normed hidden states ``[B, n, h]`` of ``tokens`` ``[B, n]`` that follow the ``length``
    positions already in ``cache``, and the cache with these ``n`` positions appended."""
    start, count, capacity = int(cache["length"]), tokens.shape[1], cache_capacity(cache)
    if start + count > capacity:
        raise ValueError(
            f"KV cache overflow: {start} cached + {count} new positions exceed its max_seq_len of {capacity}; "
            "generate fewer tokens or build the cache with a larger max_seq_len"
        )
    end = start + count
    positions = torch.arange(start, end, device=tokens.device)
    x, rope = embed(params, tokens, positions, cfg)
    visible = torch.arange(end, device=tokens.device)[None, :] <= positions[:, None]  # [n, end]
    new_layers = {}
    for i in range(cfg.num_layers):
        p, entry = layer_params(params, cfg, i), cache["layers"][str(i)]
        attend = _latent_attention if cfg.multi_latent_attention else _grouped_attention
        heads, new_layers[str(i)] = attend(p["attn"], layers.norm(p["attn_norm"], x, cfg), cfg, rope, entry,
                                           start, end, visible)
        x = x + layers.project_out(p["attn"], heads, cfg)
        x = x + moe.feed_forward(p["mlp"], layers.norm(p["mlp_norm"], x, cfg), cfg)[0]
    hidden = layers.norm(params["final_norm"], x, cfg)
    return hidden, {"layers": new_layers, "length": torch.tensor(end, dtype=torch.int64, device=tokens.device)}


def _grouped_attention(p: Params, x: torch.Tensor, cfg: ModelConfig, rope, entry: dict, start: int, end: int,
                       visible: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Heads ``[B, a, n, d]`` of the ``n`` new positions ``start:end`` of ``x`` ``[B, n, h]`` over
    every cached position, and the layer's cache entry with their keys and values written in."""
    q, k, v = layers.project_qkv(p, x, cfg, rope)
    keys = torch.slice_scatter(entry["k"], k.transpose(1, 2).to(entry["k"].dtype), dim=2, start=start, end=end)
    values = torch.slice_scatter(entry["v"], v.transpose(1, 2).to(entry["v"].dtype), dim=2, start=start, end=end)
    heads = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys[:, :, :end].to(q.dtype), values[:, :, :end].to(q.dtype),
        attn_mask=visible, enable_gqa=cfg.num_attention_heads != cfg.query_groups,
    )
    return heads, {"k": keys, "v": values}


def _latent_attention(p: Params, x: torch.Tensor, cfg: ModelConfig, rope, entry: dict, start: int, end: int,
                      visible: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``_grouped_attention`` for multi-head latent attention: the cache holds each position's latent
    and RoPE key, and every head's keys and values are expanded from them."""
    latent, rope_key = mla.compress_kv(p, x, cfg, rope)
    latents = torch.slice_scatter(entry["latent"], latent.to(entry["latent"].dtype), dim=1, start=start, end=end)
    rope_keys = torch.slice_scatter(entry["rope_key"], rope_key.to(entry["rope_key"].dtype), dim=1, start=start, end=end)
    q = mla.queries(p, x, cfg, rope)
    k, v = mla.expand_kv(p, latents[:, :end].to(q.dtype), rope_keys[:, :end].to(q.dtype), cfg)
    heads = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible)
    return heads, {"latent": latents, "rope_key": rope_keys}
