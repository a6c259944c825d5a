"""Multi-head latent attention (DeepSeek-V2/V3, Megatron's ``MLASelfAttention``) as pure functions.

Keys and values come from one small latent per token: ``x @ wkv_down`` gives the compressed
latent ``[r_kv]`` (normed) and one RoPE key ``[d_rope]`` shared by every head; ``wkv_up``
expands the latent into each head's key part without RoPE ``[d_nope]`` and its value ``[d_v]``.
Queries are ``x @ wq``, or with ``q_lora_rank`` go through their own normed latent
(``wq_down``, ``q_norm``, ``wq_up``). A head's query and key are ``[d_nope + d_rope]``: the
RoPE part rotated, the other part not (decoupled RoPE). Generation caches only the latent and
the RoPE key, ``r_kv + d_rope`` values per token and layer (``lmfunc.model.kv_cache``), against
``2 g d`` for grouped-query attention.

Leaves (``gpt.param_specs``): ``attn.{wq [h, a (d_nope + d_rope)] | wq_down [h, r_q], q_norm,
wq_up [r_q, a (d_nope + d_rope)]; wkv_down [h, r_kv + d_rope], kv_norm, wkv_up [r_kv, a (d_nope +
d_v)], wo [a d_v, h]}``.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmfunc.config import ModelConfig
from lmfunc.model.layers import apply_rope, norm
from lmfunc.parallel.placement import gather, linear

Params = dict


def compress_kv(p: Params, x: torch.Tensor, cfg: ModelConfig,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a token keeps for attention: its normed latent ``[B, S, r_kv]`` and its rotated RoPE
    key ``[B, S, 1, d_rope]`` (one for all heads), from ``x`` ``[B, S, h]``."""
    latent, rope_key = linear(x, gather(p["wkv_down"])).split([cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
    return norm(p["kv_norm"], latent, cfg), apply_rope(rope_key.unsqueeze(2), *rope)


def expand_kv(p: Params, latent: torch.Tensor, rope_key: torch.Tensor,
              cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's keys ``[B, T, a, d_nope + d_rope]`` and values ``[B, T, a, d_v]`` from the
    latents ``[B, T, r_kv]`` and RoPE keys ``[B, T, 1, d_rope]`` of T tokens."""
    batch, tokens, _ = latent.shape
    heads, nope = cfg.num_attention_heads, cfg.qk_head_dim
    kv = linear(latent, gather(p["wkv_up"])).view(batch, tokens, heads, nope + cfg.v_head_dim)
    key_nope, value = kv.split([nope, cfg.v_head_dim], dim=-1)
    key = torch.cat([key_nope, rope_key.expand(batch, tokens, heads, cfg.qk_pos_emb_head_dim)], dim=-1)
    return key, value


def queries(p: Params, x: torch.Tensor, cfg: ModelConfig, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Queries ``[B, S, a, d_nope + d_rope]`` of ``x`` ``[B, S, h]``, their RoPE part rotated."""
    batch, seq, _ = x.shape
    if "wq" in p:
        q = linear(x, gather(p["wq"]))
    else:
        q = linear(norm(p["q_norm"], linear(x, gather(p["wq_down"])), cfg), gather(p["wq_up"]))
    q = q.view(batch, seq, cfg.num_attention_heads, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
    q_nope, q_rope = q.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
    return torch.cat([q_nope, apply_rope(q_rope, *rope)], dim=-1)


def project_qkv(p: Params, x: torch.Tensor, cfg: ModelConfig,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's queries and keys ``[B, S, a, d_nope + d_rope]`` and values ``[B, S, a, d_v]`` of ``x``
    ``[B, S, h]`` (``layers.project_qkv``'s counterpart; RoPE tables of ``d_rope`` dims)."""
    latent, rope_key = compress_kv(p, x, cfg, rope)
    return (queries(p, x, cfg, rope), *expand_kv(p, latent, rope_key, cfg))


def cache_values_per_token(cfg: ModelConfig) -> int:
    """Values one token keeps in the KV cache per layer: ``r_kv + d_rope`` with MLA, ``2 g d``
    (keys and values of every group) otherwise."""
    if cfg.multi_latent_attention:
        return cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    return 2 * cfg.query_groups * cfg.head_dim
