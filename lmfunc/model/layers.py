"""Transformer layers as pure functions of (params, activations, config).

Weights are stored ``[in, out]`` (JAX layout): a projection is ``x @ w``. Shapes below use
B batch, S sequence, h hidden, a query heads, g key/value groups, d head dim, f MLP width.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from lmfunc.config import ModelConfig
from lmfunc.model.recompute import checkpointed
from lmfunc.parallel.context import (ContextMask, context_mask, context_parallel_attention, is_context_parallel,
                                     token_index)
from lmfunc.parallel.placement import gather, linear, run_local

Params = dict
Stream = Union[int, torch.Tensor]
"""A dropout stream: an int, or a 0-dim integer tensor of the same value."""


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (bf16/fp16 -> fp32; fp32 and fp64 unchanged)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def norm(p: Params, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """RMSNorm (``p = {"scale"}``) or LayerNorm (``p = {"scale", "bias"}``) over the last dim, in >= fp32."""
    xf = upcast(x)
    if cfg.normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon)
        return (y * upcast(gather(p["scale"]))).to(x.dtype)
    y = F.layer_norm(xf, xf.shape[-1:], upcast(gather(p["scale"])), upcast(gather(p["bias"])), cfg.norm_epsilon)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- randomness
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for 32-bit values held in int64, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (the "lowbias32" finaliser) applied elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, shape: tuple[int, ...], stream: Stream) -> torch.Tensor:
    """Counter-based uniform [0, 1) numbers: a pure function of (seed, stream, element index).

    ``seed`` is an integer tensor (so a new seed never recompiles), ``stream`` an int that
    separates call sites (layer and site), or a 0-dim integer tensor of the same value (a block
    run by ``scan`` has its index as a tensor): both give the same numbers. No global RNG state
    is read or written.
    """
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=seed.device).view(shape)
    stream_bits = (stream.to(torch.int64) if isinstance(stream, torch.Tensor)
                   else torch.tensor(stream, dtype=torch.int64, device=seed.device)) & 0xFFFFFFFF
    key = _hash32((seed.to(torch.int64) & 0xFFFFFFFF) ^ _hash32(stream_bits))
    bits = _hash32(_hash32(index & 0xFFFFFFFF) ^ key ^ ((index >> 32) & 0xFFFFFFFF))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


def dropout(x: torch.Tensor, rate: float, seed: Optional[torch.Tensor], stream: Stream) -> torch.Tensor:
    """Inverted dropout with an explicit seed; identity when ``rate == 0`` or ``seed is None``."""
    if rate == 0.0 or seed is None:
        return x
    keep = uniform(seed, tuple(x.shape), stream) >= rate
    return torch.where(keep, x / (1.0 - rate), torch.zeros_like(x))


# ----------------------------------------------------------------------------- positions
def rope_tables(positions: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[..., S, rotary_dim]`` (fp32) for integer ``positions`` ``[..., S]``."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    pos = positions.to(torch.float32)
    if cfg.seq_len_interpolation_factor is not None:
        pos = pos / cfg.seq_len_interpolation_factor
    angles = pos[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` ``[B, S, heads, d]`` (half-split layout).

    ``cos``/``sin`` are ``[S, r]`` or ``[B, S, r]``; the remaining ``d - r`` dims pass through.
    """
    r = cos.shape[-1]
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    first, second = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat([-second, first], dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if r < x.shape[-1] else out


# ----------------------------------------------------------------------------- attention
def attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask: causal and block-diagonal over documents (True = attend)."""
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal & same_doc)[:, None]


Mask = Union[None, torch.Tensor, ContextMask]
"""What attention masks with: None (causal), ``attention_mask``'s ``[B, 1, S, S]``, or, for a
sequence split over ``cp``, the tokens' original indices and document ids (``ContextMask``)."""


def positions_and_mask(tokens: torch.Tensor, positions: Optional[torch.Tensor],
                       doc_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, Mask]:
    """The positions of ``tokens`` ``[B, S]`` (``positions``, or by default each token's index) and
    the attention mask of its layers. A sequence split over ``cp`` (``lmfunc.parallel.context``) is
    held in load-balanced order, so its default positions are the tokens' original indices, and
    its mask is a ``ContextMask``."""
    if is_context_parallel(tokens):
        index = token_index(tokens)
        return (index if positions is None else positions), context_mask(index, doc_ids)
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
    return positions, (attention_mask(doc_ids) if doc_ids is not None else None)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **options)``: q ``[B, a, S, d]``, k ``[B, g, T, d]``,
    v ``[B, g, T, dv]`` -> ``[B, a, S, dv]``. Values narrower than the keys (MLA's ``v_head_dim``) are
    zero-padded to ``d`` on the CPU, whose fused (flash) kernel takes one head dim only: without it
    torch falls back to the math path, which materialises the masked scores ``[B, a, S, T]`` and
    keeps them for the backward. The padded output columns are zeros and are dropped; the scale
    ``1 / sqrt(d)`` depends on the queries only, so the result is the same."""
    pad = q.shape[-1] - v.shape[-1]
    if pad <= 0 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, **options)
    return F.scaled_dot_product_attention(q, k, F.pad(v, (0, pad)), **options)[..., :v.shape[-1]]


def _attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
    cfg: ModelConfig, seed: Optional[torch.Tensor], stream: Stream,
) -> torch.Tensor:
    """Softmax attention. q ``[B, a, S, d]``, k/v ``[B, g, S, d]`` -> ``[B, a, S, d]``."""
    if isinstance(mask, ContextMask):
        return context_parallel_attention(q, k, v, mask)
    if cfg.attention_dropout > 0.0 and seed is not None:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (upcast(q) @ upcast(k).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if mask is None:
            seq = q.shape[-2]
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        probs = dropout(probs, cfg.attention_dropout, seed, stream)
        return (probs.to(v.dtype) @ v)
    enable_gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return run_local(lambda q, k, v: fused_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa),
                         q, k, v)
    return run_local(lambda q, k, v, m: fused_attention(q, k, v, attn_mask=m, enable_gqa=enable_gqa),
                     q, k, v, mask)


def project_qkv(
    p: Params, x: torch.Tensor, cfg: ModelConfig, rope: Optional[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[B, S, a, d]`` and keys/values ``[B, S, g, d]`` of ``x`` ``[B, S, h]`` (QK-norm and RoPE applied)."""
    batch, seq, _ = x.shape
    d, heads, groups = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
    q, k, v = linear(x, gather(p["wq"])), linear(x, gather(p["wk"])), linear(x, gather(p["wv"]))
    if cfg.add_bias_linear:
        q, k, v = q + gather(p["bq"]), k + gather(p["bk"]), v + gather(p["bv"])
    q = q.view(batch, seq, heads, d)
    k = k.view(batch, seq, groups, d)
    v = v.view(batch, seq, groups, d)
    if cfg.qk_layernorm:
        q, k = norm(p["q_norm"], q, cfg), norm(p["k_norm"], k, cfg)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k, v


def project_out(p: Params, heads_out: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The output projection of attention heads ``[B, a, S, d]`` -> ``[B, S, h]``."""
    batch, _, seq, _ = heads_out.shape
    out = linear(heads_out.transpose(1, 2).reshape(batch, seq, -1), gather(p["wo"]))
    return out + gather(p["bo"]) if cfg.add_bias_linear else out


def attention(
    p: Params, x: torch.Tensor, cfg: ModelConfig,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]], mask: Mask,
    seed: Optional[torch.Tensor] = None, stream: Stream = 0, project: Optional[Callable] = None,
) -> torch.Tensor:
    """Causal self-attention (MHA/GQA/MQA) ``[B, S, h] -> [B, S, h]``.

    ``mask``: see ``Mask`` (``positions_and_mask`` makes it).
    ``project``: ``(p, x, cfg, rope) -> (q, k, v)``, ``project_qkv`` by default (multi-head latent
    attention passes its own, ``lmfunc.model.mla.project_qkv``).
    """
    q, k, v = (project or project_qkv)(p, x, cfg, rope)
    core = checkpointed(_attention_core) if cfg.recompute_granularity == "selective" else _attention_core
    out = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, cfg, seed, stream)
    return project_out(p, out, cfg)


def mlp(p: Params, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """SwiGLU ``(silu(x Wg) * x Wu) Wd`` or GeLU ``gelu(x W1) W2``: ``[B, S, h] -> [B, S, h]``."""
    if cfg.activation == "swiglu":
        gate, up = linear(x, gather(p["w_gate"])), linear(x, gather(p["w_up"]))
        if cfg.add_bias_linear:
            gate, up = gate + gather(p["b_gate"]), up + gather(p["b_up"])
        hidden = F.silu(gate) * up
    else:
        hidden = linear(x, gather(p["w_in"]))
        if cfg.add_bias_linear:
            hidden = hidden + gather(p["b_in"])
        hidden = F.gelu(hidden)
    out = linear(hidden, gather(p["w_out"]))
    return out + gather(p["b_out"]) if cfg.add_bias_linear else out
