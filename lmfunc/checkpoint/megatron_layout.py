"""Megatron-LM's names and fused layouts: lmfunc params <-> the state dict of megatron-core's
``GPTModel``, one layer at a time (``decoder.layers.<i>.*``).

Names. Megatron's local layer spec and Transformer Engine's (TE) spell a layer's norms
differently: the local spec has ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``; TE fuses
each norm into the linear layer after it, ``self_attention.linear_qkv.layer_norm_weight`` and
``mlp.linear_fc1.layer_norm_weight`` (``layer_norm_bias`` with LayerNorm). Both spellings are read;
TE's is written, as GPU runs write it and as ``torch_dist`` stores it for either spec.

Layouts. Megatron's linear weights are ``nn.Linear``'s ``[out, in]``; lmfunc's are ``[in, out]``
(``x @ w``), so every matrix is transposed. Two of Megatron's weights fuse several of lmfunc's:
- ``self_attention.linear_qkv`` ``[g (r + 2) d, h]`` (and its bias ``[g (r + 2) d]``): for each of
  the ``g`` query groups in turn, its ``r = heads / g`` query heads, then its key head, then its
  value head, ``d`` rows each. lmfunc's ``wq`` ``[h, heads d]``, ``wk`` and ``wv`` ``[h, g d]``.
- ``mlp.linear_fc1`` ``[2 f, h]`` with SwiGLU: the gate's ``f`` rows, then the up projection's
  (lmfunc's ``w_gate``, ``w_up``); ``[f, h]`` with GELU (``w_in``).
The output layer ``[V, h]`` is lmfunc's ``output`` ``[h, V]``; with tied embeddings Megatron's
model has none (``embedding.word_embeddings.weight`` serves both).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.model import param_shapes
from lmfunc.model.gpt import stack_layers, unstack_layers
from lmfunc.tree import PyTree, flatten_with_paths, tree_map_with_path

TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
"""A layer's norms: the local spec's name -> TE's fused name (suffixes of ``decoder.layers.<i>.``)."""

_PLAIN = [
    # (lmfunc leaf, Megatron name (local spec), transposed)
    ("attn_norm.scale", "input_layernorm.weight", False),
    ("attn_norm.bias", "input_layernorm.bias", False),
    ("attn.wo", "self_attention.linear_proj.weight", True),
    ("attn.bo", "self_attention.linear_proj.bias", False),
    ("attn.q_norm.scale", "self_attention.q_layernorm.weight", False),
    ("attn.q_norm.bias", "self_attention.q_layernorm.bias", False),
    ("attn.k_norm.scale", "self_attention.k_layernorm.weight", False),
    ("attn.k_norm.bias", "self_attention.k_layernorm.bias", False),
    ("mlp_norm.scale", "pre_mlp_layernorm.weight", False),
    ("mlp_norm.bias", "pre_mlp_layernorm.bias", False),
    ("mlp.w_in", "mlp.linear_fc1.weight", True),
    ("mlp.b_in", "mlp.linear_fc1.bias", False),
    ("mlp.w_out", "mlp.linear_fc2.weight", True),
    ("mlp.b_out", "mlp.linear_fc2.bias", False),
]
"""Layer leaves that are one Megatron tensor each."""

_GLOBAL = [
    ("embed.tokens", "embedding.word_embeddings.weight", False),
    ("embed.positions", "embedding.position_embeddings.weight", False),
    ("final_norm.scale", "decoder.final_layernorm.weight", False),
    ("final_norm.bias", "decoder.final_layernorm.bias", False),
    ("output", "output_layer.weight", True),
]

EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
"""A dense layer's linear modules, each with an ``_extra_state`` in Megatron's saves."""

UNSUPPORTED_FOR_NOW = (
    ("num_experts", "mixture-of-experts layers"),
    ("multi_latent_attention", "multi-latent attention"),
    ("mtp_num_layers", "multi-token prediction layers"),
)
"""Model settings whose Megatron layout this module does not map yet: (field, what it is)."""


def check_megatron_mappable(cfg: ModelConfig, source: str) -> None:
    """Raise ``ConfigError`` naming each setting of ``cfg`` whose Megatron layout is not mapped."""
    found = [f"{what} (model.{field} is {getattr(cfg, field)!r})" for field, what in UNSUPPORTED_FOR_NOW
             if getattr(cfg, field) not in (None, False, 0)]
    if found:
        raise ConfigError(f"{source}: lmfunc does not map Megatron's layout of " + ", ".join(found)
                          + " yet; dense models (GQA, SwiGLU or GELU, RoPE or learned positions, RMSNorm or LayerNorm, "
                            "QK-norm, biases, tied or untied embeddings) are mapped")


def _unstacked(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, scan_layers=False)


def _qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query groups g, query heads per group r, head dim d) of ``linear_qkv``."""
    return cfg.query_groups, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows from lmfunc's ``[..., heads d]`` and ``[..., g d]`` columns
    (weights ``[h, .]`` or biases ``[.]``): ``[g (r + 2) d, h]`` or ``[g (r + 2) d]``."""
    g, r, d = _qkv_rows(cfg)
    lead = q.shape[:-1]
    q = q.reshape(*lead, g, r * d)
    k, v = k.reshape(*lead, g, d), v.reshape(*lead, g, d)
    fused = torch.cat([q, k, v], dim=-1).reshape(*lead, g * (r + 2) * d)
    return fused.t().contiguous() if fused.dim() == 2 else fused.contiguous()


def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_qkv``: lmfunc's ``wq``, ``wk``, ``wv`` (or ``bq``, ``bk``, ``bv``)."""
    g, r, d = _qkv_rows(cfg)
    columns = fused.t() if fused.dim() == 2 else fused
    lead = columns.shape[:-1]
    grouped = columns.reshape(*lead, g, (r + 2) * d)
    q, k, v = grouped.split([r * d, d, d], dim=-1)
    return (q.reshape(*lead, g * r * d).contiguous(), k.reshape(*lead, g * d).contiguous(),
            v.reshape(*lead, g * d).contiguous())


def to_megatron_layers(params: PyTree, cfg: ModelConfig, spelling: str = "te") -> dict[str, torch.Tensor]:
    """Megatron-named, ``[out, in]`` tensors of full (consolidated) ``params``: the state dict of
    megatron-core's ``GPTModel`` (``spelling`` 'te' or 'local' for the layer norms), layers as
    ``decoder.layers.<i>.*``."""
    if spelling not in ("te", "local"):
        raise ValueError(f"spelling must be 'te' or 'local', got {spelling!r}")
    check_megatron_mappable(cfg, "Megatron export")
    if cfg.scan_layers:
        params = unstack_layers(params, cfg.num_layers)
    leaves = {name: leaf.detach() for name, leaf in flatten_with_paths(params)}
    out: dict[str, torch.Tensor] = {}
    for ours, theirs, transposed in _GLOBAL:
        if ours in leaves:
            out[theirs] = (leaves[ours].t() if transposed else leaves[ours]).contiguous()
    for i in range(cfg.num_layers):
        mine = {name.removeprefix(f"layers.{i}."): leaf for name, leaf in leaves.items() if name.startswith(f"layers.{i}.")}
        layer: dict[str, torch.Tensor] = {}
        for ours, theirs, transposed in _PLAIN:
            if ours in mine:
                layer[theirs] = (mine[ours].t() if transposed else mine[ours]).contiguous()
        layer["self_attention.linear_qkv.weight"] = fuse_qkv(mine["attn.wq"], mine["attn.wk"], mine["attn.wv"], cfg)
        if "attn.bq" in mine:
            layer["self_attention.linear_qkv.bias"] = fuse_qkv(mine["attn.bq"], mine["attn.bk"], mine["attn.bv"], cfg)
        if "mlp.w_gate" in mine:
            layer["mlp.linear_fc1.weight"] = torch.cat([mine["mlp.w_gate"], mine["mlp.w_up"]], dim=1).t().contiguous()
            if "mlp.b_gate" in mine:
                layer["mlp.linear_fc1.bias"] = torch.cat([mine["mlp.b_gate"], mine["mlp.b_up"]]).contiguous()
        for name, tensor in layer.items():
            name = TE_NORM_NAMES.get(name, name) if spelling == "te" else name
            out[f"decoder.layers.{i}.{name}"] = tensor
    return out


def _local_spelling(name: str) -> str:
    """``name`` with TE's fused norm names spelled as the local spec's."""
    for local, te in TE_NORM_NAMES.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def from_megatron_layers(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> PyTree:
    """lmfunc params (fp32, ``cfg``'s tree; stacked with ``scan_layers``) from a Megatron
    ``GPTModel`` state dict in either spelling (``_extra_state`` entries ignored). Every tensor
    lmfunc needs must be there with the shape ``cfg`` implies: the first that is missing or
    disagrees is named, with ``source``."""
    check_megatron_mappable(cfg, source)
    named = {_local_spelling(name): tensor for name, tensor in tensors.items() if not name.endswith("._extra_state")}

    def take(theirs: str, transposed: bool, shape: tuple[int, ...], what: str) -> torch.Tensor:
        if theirs not in named:
            spelled = TE_NORM_NAMES.get(theirs.split(".", 3)[-1]) if theirs.startswith("decoder.layers.") else None
            also = f" (or {theirs.rsplit('.', 3)[0]}...{spelled})" if spelled else ""
            raise ConfigError(f"{source} has no tensor {theirs}{also}, which the model config needs for {what}; "
                              "check the model settings against the checkpoint's (a bias needs --model.add-bias-linear, "
                              "a position table --model.position-embedding-type learned_absolute)")
        tensor = named[theirs].t() if transposed else named[theirs]
        if tuple(tensor.shape) != shape:
            want = shape[::-1] if transposed else shape
            raise ConfigError(f"{source}: {theirs} has shape {tuple(named[theirs].shape)}, but the model config "
                              f"implies {want} for {what}; check the model settings against the checkpoint's")
        # A copy: the layers of a torch_dist save are views of one stacked tensor, and a training
        # step that updates its state in place needs every leaf in a storage of its own.
        return tensor.to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    fused_parts: dict[str, tuple[str, Callable[[torch.Tensor], tuple[torch.Tensor, ...]], tuple[str, ...]]] = {
        "attn.wq": ("self_attention.linear_qkv.weight", lambda t: split_qkv(t, cfg), ("attn.wq", "attn.wk", "attn.wv")),
        "attn.bq": ("self_attention.linear_qkv.bias", lambda t: split_qkv(t, cfg), ("attn.bq", "attn.bk", "attn.bv")),
        "mlp.w_gate": ("mlp.linear_fc1.weight", lambda t: tuple(t.t().chunk(2, dim=1)), ("mlp.w_gate", "mlp.w_up")),
        "mlp.b_gate": ("mlp.linear_fc1.bias", lambda t: tuple(t.chunk(2)), ("mlp.b_gate", "mlp.b_up")),
    }
    split_cache: dict[str, dict[str, torch.Tensor]] = {}
    like_tree = param_shapes(_unstacked(cfg))
    shapes = dict(flatten_with_paths(like_tree))

    def fill(name: str, like: torch.Tensor) -> torch.Tensor:
        for ours, theirs, transposed in _GLOBAL:
            if name == ours:
                return take(theirs, transposed, tuple(like.shape), name).contiguous()
        _, i, leaf = name.split(".", 2)
        for ours, theirs, transposed in _PLAIN:
            if leaf == ours:
                return take(f"decoder.layers.{i}.{theirs}", transposed, tuple(like.shape), name).contiguous()
        for first, (theirs, split, parts) in fused_parts.items():
            if leaf in parts:
                key = f"{i}.{first}"
                if key not in split_cache:
                    fused_shape = _fused_shape(theirs, parts, i, shapes)
                    fused = take(f"decoder.layers.{i}.{theirs}", False, fused_shape, f"layers.{i}.{'/'.join(parts)}")
                    split_cache[key] = dict(zip(parts, split(fused)))
                return split_cache[key][leaf].clone(memory_format=torch.contiguous_format)  # its own storage
        raise ConfigError(f"{source}: lmfunc has no Megatron name for its parameter {name}")

    params = tree_map_with_path(fill, like_tree)
    return stack_layers(params) if cfg.scan_layers else params


def _fused_shape(theirs: str, parts: tuple[str, ...], i: str, shapes: dict) -> tuple[int, ...]:
    """Megatron's shape of the fused ``theirs`` made of lmfunc's ``parts`` of layer ``i``."""
    widths = [shapes[f"layers.{i}.{part}"].shape[-1] for part in parts]
    rows = sum(widths)
    if theirs.endswith(".weight"):
        return (rows, shapes[f"layers.{i}.{parts[0]}"].shape[0])
    return (rows,)
