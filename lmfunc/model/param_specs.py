"""The parameter table of the GPT model: every leaf's shape, logical axes and initialiser
(``param_specs``), from which ``init``, ``param_axes`` and ``param_shapes`` are read, so they can
never disagree. The tree's layout is described in ``lmfunc.model.gpt``.
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import torch

from lmfunc.config import ConfigError, ModelConfig
from lmfunc.config.model import unbuildable_features
from lmfunc.tree import Axes, tree_map, tree_map_with_path

LAYER_AXIS = "layers"
"""Logical name of the leading axis of stacked block leaves (``ModelConfig.scan_layers``)."""

Params = dict


class LeafSpec(NamedTuple):
    """Shape, logical axis names and initialiser ("normal", "scaled_normal", "ones", "zeros") of a
    leaf; ``trainable`` False for state that the step sets without a gradient."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str
    trainable: bool = True


def _norm_spec(cfg: ModelConfig, size: int, axis: str) -> dict:
    spec = {"scale": LeafSpec((size,), (axis,), "ones")}
    if cfg.normalization == "LayerNorm":
        spec["bias"] = LeafSpec((size,), (axis,), "zeros")
    return spec


def _layer_spec(cfg: ModelConfig, is_moe: bool = False) -> dict:
    """One transformer block; its MLP an MoE layer when ``is_moe``."""
    return {
        "attn_norm": _norm_spec(cfg, cfg.hidden_size, "embed"),
        "attn": _mla_spec(cfg) if cfg.multi_latent_attention else _attention_spec(cfg),
        "mlp_norm": _norm_spec(cfg, cfg.hidden_size, "embed"),
        "mlp": _moe_spec(cfg) if is_moe else _mlp_spec(cfg, cfg.ffn_size),
    }


def _mla_spec(cfg: ModelConfig) -> dict:
    """Multi-head latent attention (``lmfunc.model.mla``): the latents' down-projections (replicated
    over ``tp``) and norms, the per-head up-projections and output (split by heads)."""
    h, a = cfg.hidden_size, cfg.num_attention_heads
    qk, v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        attn = {"wq": LeafSpec((h, a * qk), ("embed", "heads"), "normal")}
    else:
        attn = {"wq_down": LeafSpec((h, cfg.q_lora_rank), ("embed", "q_lora"), "normal"),
                "q_norm": _norm_spec(cfg, cfg.q_lora_rank, "q_lora"),
                "wq_up": LeafSpec((cfg.q_lora_rank, a * qk), ("q_lora", "heads"), "normal")}
    return attn | {
        "wkv_down": LeafSpec((h, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim), ("embed", "kv_lora"), "normal"),
        "kv_norm": _norm_spec(cfg, cfg.kv_lora_rank, "kv_lora"),
        "wkv_up": LeafSpec((cfg.kv_lora_rank, a * (cfg.qk_head_dim + v)), ("kv_lora", "heads"), "normal"),
        "wo": LeafSpec((a * v, h), ("heads", "embed"), "scaled_normal"),
    }


def _attention_spec(cfg: ModelConfig) -> dict:
    """Multi-head / grouped-query attention."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.query_groups * d
    attn = {
        "wq": LeafSpec((h, q_out), ("embed", "heads"), "normal"),
        "wk": LeafSpec((h, kv_out), ("embed", "kv_heads"), "normal"),
        "wv": LeafSpec((h, kv_out), ("embed", "kv_heads"), "normal"),
        "wo": LeafSpec((q_out, h), ("heads", "embed"), "scaled_normal"),
    }
    if cfg.add_bias_linear:
        attn |= {
            "bq": LeafSpec((q_out,), ("heads",), "zeros"),
            "bk": LeafSpec((kv_out,), ("kv_heads",), "zeros"),
            "bv": LeafSpec((kv_out,), ("kv_heads",), "zeros"),
            "bo": LeafSpec((h,), ("embed",), "zeros"),
        }
    if cfg.qk_layernorm:
        attn |= {"q_norm": _norm_spec(cfg, d, "head_dim"), "k_norm": _norm_spec(cfg, d, "head_dim")}
    return attn


def _mlp_spec(cfg: ModelConfig, f: int) -> dict:
    """A dense MLP of width ``f``."""
    h = cfg.hidden_size
    inputs = ("w_gate", "w_up") if cfg.activation == "swiglu" else ("w_in",)
    mlp = {name: LeafSpec((h, f), ("embed", "mlp"), "normal") for name in inputs}
    mlp["w_out"] = LeafSpec((f, h), ("mlp", "embed"), "scaled_normal")
    if cfg.add_bias_linear:
        mlp |= {"b" + name[1:]: LeafSpec((f,), ("mlp",), "zeros") for name in inputs}
        mlp["b_out"] = LeafSpec((h,), ("embed",), "zeros")
    return mlp


def _moe_spec(cfg: ModelConfig) -> dict:
    """An MoE layer (``lmfunc.model.moe.moe_mlp``): router, routed experts, optional shared experts."""
    h, e, f = cfg.hidden_size, cfg.num_experts, cfg.expert_ffn_size
    router = {"weight": LeafSpec((h, e), ("embed", "router"), "normal")}
    if cfg.moe_router_enable_expert_bias:
        router["expert_bias"] = LeafSpec((e,), ("router",), "zeros", trainable=False)
    spec = {
        "router": router,
        "experts": {
            "w_gate": LeafSpec((e, h, f), ("experts", "embed", "expert_mlp"), "normal"),
            "w_up": LeafSpec((e, h, f), ("experts", "embed", "expert_mlp"), "normal"),
            "w_out": LeafSpec((e, f, h), ("experts", "expert_mlp", "embed"), "scaled_normal"),
        },
    }
    if cfg.moe_shared_expert_intermediate_size:
        spec["shared_experts"] = _mlp_spec(cfg, cfg.moe_shared_expert_intermediate_size)
    return spec


def param_specs(cfg: ModelConfig) -> Params:
    """The parameter tree with a ``LeafSpec`` at every leaf. A ``ConfigError`` names the MoE and MLA
    settings the model cannot build (``unbuildable_features``)."""
    unbuildable = unbuildable_features(cfg)
    if unbuildable:
        raise ConfigError(f"{'; '.join(unbuildable)}: not implemented in this version of lmfunc")
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = {"tokens": LeafSpec((v, h), ("vocab", "embed"), "normal")}
    if cfg.position_embedding_type == "learned_absolute":
        embed["positions"] = LeafSpec((cfg.max_position_embeddings, h), ("position", "embed"), "normal")
    specs: Params = {
        "embed": embed,
        "layers": _stacked_layer_spec(cfg) if cfg.scan_layers else {
            str(i): _layer_spec(cfg, is_moe) for i, is_moe in enumerate(cfg.moe_layers)},
        "final_norm": _norm_spec(cfg, h, "embed"),
    }
    if not cfg.tie_embeddings:
        specs["output"] = LeafSpec((h, v), ("embed", "vocab"), "normal")
    if cfg.mtp_num_layers > 0:
        specs["mtp"] = {str(k): _mtp_spec(cfg) for k in range(cfg.mtp_num_layers)}
    return specs


def _stacked_layer_spec(cfg: ModelConfig) -> dict:
    """One block's specs with a leading ``[L]`` axis named ``LAYER_AXIS`` on every leaf."""
    return tree_map(lambda s: LeafSpec((cfg.num_layers, *s.shape), (LAYER_AXIS, *s.axes), s.init, s.trainable),
                    _layer_spec(cfg), is_leaf=_is_spec)


def _mtp_spec(cfg: ModelConfig) -> dict:
    """One multi-token-prediction depth: norms of the embedding and of the previous hidden state,
    the ``[2h, h]`` projection of their concatenation, one transformer layer (an MoE layer when the
    decoder's last layer is one, as Megatron builds it) and its final norm."""
    h = cfg.hidden_size
    return {
        "enorm": _norm_spec(cfg, h, "embed"),
        "hnorm": _norm_spec(cfg, h, "embed"),
        "eh_proj": LeafSpec((2 * h, h), ("mtp_concat", "embed"), "normal"),
        "layer": _layer_spec(cfg, cfg.moe_layers[-1]),
        "final_norm": _norm_spec(cfg, h, "embed"),
    }


def _is_spec(x: object) -> bool:
    return isinstance(x, LeafSpec)


def param_axes(cfg: ModelConfig) -> Params:
    """Same tree as ``init(cfg)`` with the leaf's logical axis names (an ``Axes``) at each leaf."""
    return tree_map(lambda s: Axes(s.axes), param_specs(cfg), is_leaf=_is_spec)


def param_shapes(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> Params:
    """Same tree as ``init(cfg)`` with ``meta`` tensors: shapes and dtypes, no storage."""
    return tree_map(lambda s: torch.empty(s.shape, dtype=dtype, device="meta"), param_specs(cfg), is_leaf=_is_spec)


def leaf_seed(seed: int, path: str) -> int:
    """Seed of one leaf: depends only on the model seed and the leaf's dotted name."""
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def init_leaf(spec: LeafSpec, path: str, cfg: ModelConfig, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Megatron init of one leaf: N(0, std), output projections N(0, std / sqrt(2 L)), norms 1, biases 0.

    A stacked block leaf (``layers.attn.wq``, leading axis ``LAYER_AXIS``) is the stack of the
    unstacked model's leaves ``layers.<i>.attn.wq``, so both layouts start from the same weights."""
    if spec.axes[:1] == (LAYER_AXIS,):
        inner, rest = LeafSpec(spec.shape[1:], spec.axes[1:], spec.init, spec.trainable), path.split(".", 1)[1]
        return torch.stack([init_leaf(inner, f"layers.{i}.{rest}", cfg, seed, dtype) for i in range(spec.shape[0])])
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=dtype)
    std = cfg.init_method_std
    if spec.init == "scaled_normal":
        std = std / math.sqrt(2.0 * cfg.num_layers)
    generator = torch.Generator().manual_seed(leaf_seed(seed, path))
    return (torch.randn(spec.shape, generator=generator, dtype=torch.float32) * std).to(dtype)


def init(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Params:
    """Initialise all parameters. Each leaf is drawn from its own generator seeded by
    ``(seed, dotted name)``, so a leaf's values never depend on which other leaves exist."""

    def make(path: str, spec: LeafSpec) -> torch.Tensor:
        return init_leaf(spec, path, cfg, seed, dtype).to(device)

    return tree_map_with_path(make, param_specs(cfg), is_leaf=_is_spec)
