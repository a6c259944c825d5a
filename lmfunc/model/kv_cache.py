"""Incremental decoding with a key/value cache, as pure functions.

The cache is a pytree ``{"layers": {"<i>": {"k", "v"}}, "length"}`` with keys/values
``[B, g, T, d]`` for ``T = max_seq_len`` positions and ``length`` (an int64 scalar) positions
filled. ``forward_cached`` takes the cache and returns a new one; nothing is mutated.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lmfunc.config import ModelConfig
from lmfunc.model import layers, moe
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
    shape = (batch, cfg.query_groups, length, cfg.head_dim)
    return {
        "layers": {
            str(i): {"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device)}
            for i in range(cfg.num_layers)
        },
        "length": torch.zeros((), dtype=torch.int64, device=device),
    }


def cache_capacity(cache: Cache) -> int:
    """Positions the cache can hold (``T``)."""
    return cache["layers"]["0"]["k"].shape[2]


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
        q, k, v = layers.project_qkv(p["attn"], layers.norm(p["attn_norm"], x, cfg), cfg, rope)
        keys = torch.slice_scatter(entry["k"], k.transpose(1, 2).to(entry["k"].dtype), dim=2, start=start, end=end)
        values = torch.slice_scatter(entry["v"], v.transpose(1, 2).to(entry["v"].dtype), dim=2, start=start, end=end)
        heads = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys[:, :, :end].to(q.dtype), values[:, :, :end].to(q.dtype),
            attn_mask=visible, enable_gqa=cfg.num_attention_heads != cfg.query_groups,
        )
        x = x + layers.project_out(p["attn"], heads, cfg)
        x = x + moe.feed_forward(p["mlp"], layers.norm(p["mlp_norm"], x, cfg), cfg)[0]
        new_layers[str(i)] = {"k": keys, "v": values}
    hidden = layers.norm(params["final_norm"], x, cfg)
    return hidden, {"layers": new_layers, "length": torch.tensor(end, dtype=torch.int64, device=tokens.device)}
