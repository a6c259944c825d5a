"""Megatron-LM's names and fused layouts: lmfunc params <-> the state dict of megatron-core's
``GPTModel``: decoder layers (``decoder.layers.<i>.*``), multi-token-prediction layers
(``mtp.layers.<k>.*``, each with a ``transformer_layer``, which megatron-core 0.19 calls
``mtp_model_layer``: both are read, and an export writes both), the embedding and the output layer.

Layouts. Megatron's linear weights are ``nn.Linear``'s ``[out, in]``; lmfunc's are ``[in, out]``
(``x @ w``), so every matrix is transposed. Some of Megatron's tensors fuse several of lmfunc's:
- ``self_attention.linear_qkv`` ``[g (r + 2) d, h]`` (and its bias): for each of the ``g`` query
  groups in turn, its ``r = heads / g`` query heads, then its key head, then its value head, ``d``
  rows each. lmfunc's ``wq`` ``[h, heads d]``, ``wk`` and ``wv`` ``[h, g d]``.
- ``linear_fc1`` ``[2 f, h]`` with SwiGLU: the gate's ``f`` rows, then the up projection's
  (lmfunc's ``w_gate``, ``w_up``); ``[f, h]`` with GELU (``w_in``). The same for shared experts.
- routed experts, as a ``torch_dist`` save stores them: ``mlp.experts.experts.linear_fc1.weight``
  ``[E, 2 f, h]`` and ``linear_fc2.weight`` ``[E, h, f]`` (lmfunc's ``[E, h, f]`` ``w_gate`` and
  ``w_up``, ``[E, f, h]`` ``w_out``). A module's state dict holds them per expert instead: the
  sequential experts' ``local_experts.<e>.linear_fc1.weight``, Transformer Engine's grouped
  ``linear_fc1.weight<e>``, or the legacy grouped GEMM's ``weight1`` ``[h, E 2 f]`` and
  ``weight2`` ``[E f, h]`` (one ``[E, h, 2 f]`` and ``[E, f, h]`` block reinterpreted); all are read.
- MLA: each projection is one tensor (``linear_q_proj`` or ``linear_q_down_proj`` and
  ``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``), in lmfunc's order except
  for the RoPE dims of the queries and of the shared key: Megatron's MLA takes them as interleaved
  pairs (it gathers the even dims, then the odd ones, before rotating halves), lmfunc as halves, so
  those rows are permuted (``_rope_order``).
- MTP: ``eh_proj`` ``[h, 2 h]`` is lmfunc's ``[2 h, h]`` ``eh_proj``.
The output layer ``[V, h]`` is lmfunc's ``output`` ``[h, V]``; with tied embeddings Megatron's
model has none (``embedding.word_embeddings.weight`` serves both).

Names of the norms. Megatron's local layer spec names a module's norms ``input_layernorm``,
``pre_mlp_layernorm``, ``self_attention.{q,k,kv}_layernorm`` (``LOCAL`` spelling, a module's state
dict). Transformer Engine (TE), which GPU runs use, fuses a norm into the linear layer after it
where one follows: ``self_attention.linear_qkv.layer_norm_weight`` (not with MLA, whose input norm
feeds two projections), ``mlp.linear_fc1.layer_norm_weight`` (dense MLPs; an MoE layer keeps
``pre_mlp_layernorm``), and with MLA ``linear_q_up_proj.layer_norm_weight`` and
``linear_kv_up_proj.layer_norm_weight`` (``TE`` spelling, as a ``torch_dist`` save of a TE model
stores it). Every spelling is read. The local spec's own ``torch_dist`` keys rename a non-MLA
layer's ``input_layernorm`` and ``pre_mlp_layernorm`` as TE's dense layer does (also in an MoE
layer) and keep the MLA layer's names: ``local_spec_aliases`` gives those where they differ from
TE's, so one save loads into a model of either spec.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator

import torch

from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.model import param_shapes
from lmfunc.model.gpt import stack_layers, unstack_layers
from lmfunc.tree import PyTree, flatten_with_paths, tree_unflatten_as

EXPERTS = "mlp.experts.experts."
"""The routed experts' tensors in a ``torch_dist`` save (and here): ``linear_fc1.weight`` ``[E, 2f, h]``."""


@dataclasses.dataclass(frozen=True)
class _Rule:
    """lmfunc leaves ``ours`` (together) <-> one Megatron tensor ``theirs`` (local spelling)."""

    ours: tuple[str, ...]
    theirs: str
    fuse: Callable[..., torch.Tensor]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _same(ours: str, theirs: str) -> _Rule:
    return _Rule((ours,), theirs, lambda t: t, lambda t: (t,))


def _transposed(ours: str, theirs: str) -> _Rule:
    """A matrix (or a stack of expert matrices) with its last two dims swapped."""
    return _Rule((ours,), theirs, lambda t: t.transpose(-1, -2), lambda t: (t.transpose(-1, -2),))


def _gated(gate: str, up: str, theirs: str) -> _Rule:
    """``linear_fc1``: the gate's rows, then the up projection's (weights ``[.., 2f, h]``)."""
    return _Rule((gate, up), theirs, lambda g, u: torch.cat([g, u], dim=-1).transpose(-1, -2),
                 lambda t: tuple(t.transpose(-1, -2).chunk(2, dim=-1)))


def _gated_bias(gate: str, up: str, theirs: str) -> _Rule:
    return _Rule((gate, up), theirs, lambda g, u: torch.cat([g, u], dim=-1), lambda t: tuple(t.chunk(2, dim=-1)))


def _norm(ours: str, theirs: str) -> list[_Rule]:
    return [_same(f"{ours}.scale", f"{theirs}.weight"), _same(f"{ours}.bias", f"{theirs}.bias")]


def _mlp(ours: str, theirs: str) -> list[_Rule]:
    """A dense MLP (or the shared experts) of either activation, with or without biases."""
    return [_gated(f"{ours}.w_gate", f"{ours}.w_up", f"{theirs}.linear_fc1.weight"),
            _gated_bias(f"{ours}.b_gate", f"{ours}.b_up", f"{theirs}.linear_fc1.bias"),
            _transposed(f"{ours}.w_in", f"{theirs}.linear_fc1.weight"), _same(f"{ours}.b_in", f"{theirs}.linear_fc1.bias"),
            _transposed(f"{ours}.w_out", f"{theirs}.linear_fc2.weight"), _same(f"{ours}.b_out", f"{theirs}.linear_fc2.bias")]


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
    return fused.t() if fused.dim() == 2 else fused


def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_qkv``: lmfunc's ``wq``, ``wk``, ``wv`` (or ``bq``, ``bk``, ``bv``)."""
    g, r, d = _qkv_rows(cfg)
    columns = fused.t() if fused.dim() == 2 else fused
    lead = columns.shape[:-1]
    grouped = columns.reshape(*lead, g, (r + 2) * d)
    q, k, v = grouped.split([r * d, d, d], dim=-1)
    return q.reshape(*lead, g * r * d), k.reshape(*lead, g * d), v.reshape(*lead, g * d)


def _rope_order(w: torch.Tensor, cfg: ModelConfig, groups: int, start: int, to_megatron: bool) -> torch.Tensor:
    """``w`` ``[in, groups x width]`` (lmfunc's layout) with the ``qk_pos_emb_head_dim`` RoPE columns
    at ``start`` of each group reordered: lmfunc's halves from (``to_megatron``: to) Megatron's
    interleaved pairs, whose even dims lmfunc's first half holds and odd dims its second."""
    r = cfg.qk_pos_emb_head_dim
    halves = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    order = torch.argsort(halves) if to_megatron else halves
    grouped = w.reshape(*w.shape[:-1], groups, -1)
    rope = grouped[..., start:start + r][..., order]
    return torch.cat([grouped[..., :start], rope, grouped[..., start + r:]], dim=-1).reshape(w.shape)


def _mla_rope(ours: str, theirs: str, cfg: ModelConfig, groups: int, start: int) -> _Rule:
    """A transposed MLA projection whose output holds RoPE dims (``_rope_order``)."""
    return _Rule((ours,), theirs, lambda w: _rope_order(w, cfg, groups, start, to_megatron=True).t(),
                 lambda t: (_rope_order(t.t(), cfg, groups, start, to_megatron=False),))


def _block_rules(cfg: ModelConfig) -> list[_Rule]:
    """One transformer layer's rules (names relative to the layer); a rule applies where the
    layer has all its lmfunc leaves (a dense or MoE MLP, biases, QK-norm)."""
    att = "self_attention."
    rules = _norm("attn_norm", "input_layernorm") + _norm("mlp_norm", "pre_mlp_layernorm")
    if cfg.multi_latent_attention:
        heads, nope = cfg.num_attention_heads, cfg.qk_head_dim
        rules += [_mla_rope("attn.wq", att + "linear_q_proj.weight", cfg, heads, nope),
                  _transposed("attn.wq_down", att + "linear_q_down_proj.weight"), *_norm("attn.q_norm", att + "q_layernorm"),
                  _mla_rope("attn.wq_up", att + "linear_q_up_proj.weight", cfg, heads, nope),
                  _mla_rope("attn.wkv_down", att + "linear_kv_down_proj.weight", cfg, 1, cfg.kv_lora_rank),
                  *_norm("attn.kv_norm", att + "kv_layernorm"), _transposed("attn.wkv_up", att + "linear_kv_up_proj.weight")]
    else:
        rules += [_Rule(("attn.wq", "attn.wk", "attn.wv"), att + "linear_qkv.weight",
                        lambda q, k, v: fuse_qkv(q, k, v, cfg), lambda t: split_qkv(t, cfg)),
                  _Rule(("attn.bq", "attn.bk", "attn.bv"), att + "linear_qkv.bias",
                        lambda q, k, v: fuse_qkv(q, k, v, cfg), lambda t: split_qkv(t, cfg)),
                  *_norm("attn.q_norm", att + "q_layernorm"), *_norm("attn.k_norm", att + "k_layernorm")]
    rules += [_transposed("attn.wo", att + "linear_proj.weight"), _same("attn.bo", att + "linear_proj.bias")]
    rules += _mlp("mlp", "mlp") + _mlp("mlp.shared_experts", "mlp.shared_experts")
    rules += [_transposed("mlp.router.weight", "mlp.router.weight"), _same("mlp.router.expert_bias", "mlp.router.expert_bias"),
              _gated("mlp.experts.w_gate", "mlp.experts.w_up", EXPERTS + "linear_fc1.weight"),
              _transposed("mlp.experts.w_out", EXPERTS + "linear_fc2.weight")]
    return rules


def _model_rules(cfg: ModelConfig) -> Iterator[_Rule]:
    """Every rule of ``cfg``'s model with full names: the globals, each decoder layer, each MTP depth."""
    yield from [_same("embed.tokens", "embedding.word_embeddings.weight"),
                _same("embed.positions", "embedding.position_embeddings.weight"),
                *_norm("final_norm", "decoder.final_layernorm"), _transposed("output", "output_layer.weight")]
    blocks = [(f"layers.{i}.", f"decoder.layers.{i}.") for i in range(cfg.num_layers)]
    for k in range(cfg.mtp_num_layers):
        ours, theirs = f"mtp.{k}.", f"mtp.layers.{k}."
        yield from [*_norm(ours + "enorm", theirs + "enorm"), *_norm(ours + "hnorm", theirs + "hnorm"),
                    _transposed(ours + "eh_proj", theirs + "eh_proj.weight"),
                    *_norm(ours + "final_norm", theirs + "final_layernorm")]
        blocks.append((ours + "layer.", theirs + "transformer_layer."))
    rules = _block_rules(cfg)
    for ours, theirs in blocks:
        for rule in rules:
            yield dataclasses.replace(rule, ours=tuple(ours + name for name in rule.ours), theirs=theirs + rule.theirs)


UNMAPPED = (
    (lambda cfg: cfg.num_experts is not None and cfg.activation != "swiglu",
     "MoE with GELU (lmfunc's experts are SwiGLU, Megatron's follow --swiglu)"),
    (lambda cfg: cfg.num_experts is not None and cfg.add_bias_linear,
     "MoE with biases (lmfunc's experts have none, Megatron's follow --add-bias-linear)"),
    (lambda cfg: cfg.multi_latent_attention and cfg.add_bias_linear,
     "MLA with biases (lmfunc's MLA projections have none)"),
)
"""lmfunc models Megatron cannot express: (test, what it is)."""


def check_megatron_mappable(cfg: ModelConfig, source: str) -> None:
    """Raise ``ConfigError`` naming each setting of ``cfg`` that Megatron's model cannot express."""
    found = [what for test, what in UNMAPPED if test(cfg)]
    if found:
        raise ConfigError(f"{source}: Megatron's GPTModel has no layout for " + "; ".join(found))


def _layer_kinds(cfg: ModelConfig) -> dict[str, bool]:
    """``{Megatron layer prefix: is an MoE layer}`` of every decoder and MTP transformer layer."""
    kinds = {f"decoder.layers.{i}.": moe for i, moe in enumerate(cfg.moe_layers)}
    last_is_moe = bool(cfg.moe_layers and cfg.moe_layers[-1])
    kinds |= {f"mtp.layers.{k}.transformer_layer.": last_is_moe for k in range(cfg.mtp_num_layers)}
    return kinds


def _renamed_norms(name: str, cfg: ModelConfig, te: bool) -> str:
    """``name`` (local spelling) as TE's save names it (``te``), else as the local spec's save does."""
    for prefix, moe in _layer_kinds(cfg).items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        mla = cfg.multi_latent_attention
        renames = {}
        if not mla:
            renames["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
        if (te and not moe) or (not te and not mla):
            renames["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        if te and mla:
            renames |= {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                        "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
        for local, fused in renames.items():
            if rest.startswith(local):
                return prefix + fused + rest[len(local):]
    return name


_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
    "self_attention.linear_q_up_proj.layer_norm_": "self_attention.q_layernorm.",
    "self_attention.linear_kv_up_proj.layer_norm_": "self_attention.kv_layernorm.",
}
"""TE's fused norm names -> the local spec's (``weight``/``bias`` follow)."""
TE_NORM_NAMES = {local + part: fused + part for fused, local in _FUSED_NORMS.items() for part in ("weight", "bias")}
"""A layer's norms: the local spec's name -> TE's fused name (suffixes of a layer prefix)."""


def to_megatron_layers(params: PyTree, cfg: ModelConfig, spelling: str = "te") -> dict[str, torch.Tensor]:
    """Megatron-named, ``[out, in]`` tensors of full (consolidated) ``params``. ``spelling`` 'te':
    the names of a ``torch_dist`` save of a TE model, routed experts stacked ``[E, ...]``; 'local':
    megatron-core's local-spec ``GPTModel.state_dict()``, routed experts one by one."""
    if spelling not in ("te", "local"):
        raise ValueError(f"spelling must be 'te' or 'local', got {spelling!r}")
    check_megatron_mappable(cfg, "Megatron export")
    if cfg.scan_layers:
        params = unstack_layers(params, cfg.num_layers)
    leaves = {name: leaf.detach() for name, leaf in flatten_with_paths(params)}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for rule in _model_rules(cfg):
        if all(name in leaves for name in rule.ours):
            out[rule.theirs] = rule.fuse(*(leaves[name] for name in rule.ours)).contiguous()
            used.update(rule.ours)
    missing = sorted(set(leaves) - used)
    if missing:
        raise ConfigError(f"Megatron export: lmfunc has no Megatron name for its parameter {missing[0]}")
    if spelling == "te":
        return {_renamed_norms(name, cfg, te=True): tensor for name, tensor in out.items()}
    return {local: tensor for name, tensor in out.items() for local, tensor in _experts_one_by_one(name, tensor)}


def local_spec_aliases(te_tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The norms of ``te_tensors`` (``to_megatron_layers(..., 'te')``) under the names a local-spec
    model's ``torch_dist`` save gives them, where those differ from TE's (module docstring)."""
    out = {}
    for name, tensor in te_tensors.items():
        local = _renamed_norms(_local_norm_name(name), cfg, te=False)
        if local != name:
            out[local] = tensor
    return out


def _experts_one_by_one(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if EXPERTS not in name:
        yield name, tensor
        return
    prefix, rest = name.split(EXPERTS)
    for e, expert in enumerate(tensor.unbind(0)):
        yield f"{prefix}mlp.experts.local_experts.{e}.{rest}", expert.contiguous()


def _local_norm_name(name: str) -> str:
    for fused, local in _FUSED_NORMS.items():
        match = re.fullmatch(rf"(.*\.)?{re.escape(fused)}(weight|bias)", name)
        if match:
            return f"{match.group(1) or ''}{local}{match.group(2)}"
    return name


_PER_EXPERT = (
    re.compile(r"(?P<prefix>.*\.mlp\.experts\.)local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.weight"),
    re.compile(r"(?P<prefix>.*\.mlp\.experts\.)(?P<fc>linear_fc[12])\.weight(?P<e>\d+)"),
)
"""One expert's weight: the sequential experts' and TE's grouped experts' state-dict names."""


_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.)(transformer_layer|mtp_model_layer)\.")
"""An MTP depth's transformer layer: ``transformer_layer`` in megatron-core 0.16, ``mtp_model_layer`` in 0.19."""


def newer_megatron_aliases(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors of ``tensors`` under megatron-core 0.19's names (``mtp_model_layer``),
    so that a save holding both loads into either version's model."""
    return {_MTP_LAYER.sub(r"\1mtp_model_layer.", name, count=1): tensor
            for name, tensor in tensors.items() if _MTP_LAYER.match(name)}


def _canonical(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """``tensors`` in this module's names: norms in the local spelling, MTP layers under
    ``transformer_layer``, routed experts stacked (``EXPERTS``) from any of the per-expert forms;
    ``_extra_state`` entries dropped."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.endswith("._extra_state") or "._extra_state/" in name:
            continue
        name = _MTP_LAYER.sub(r"\1transformer_layer.", name, count=1)
        match = next((m for m in (p.fullmatch(name) for p in _PER_EXPERT) if m), None)
        if match:
            experts.setdefault(f"{match['prefix']}experts.{match['fc']}.weight", {})[int(match["e"])] = tensor
            continue
        grouped = re.fullmatch(r"(.*\.mlp\.experts\.)weight([12])", name)
        if grouped and cfg.num_experts:
            e = cfg.num_experts
            blocks = tensor.reshape(e, cfg.hidden_size, -1) if grouped[2] == "1" else tensor.reshape(e, -1, cfg.hidden_size)
            out[f"{grouped[1]}experts.linear_fc{grouped[2]}.weight"] = blocks.transpose(1, 2)
            continue
        out[_local_norm_name(name)] = tensor
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))) or len(by_index) != cfg.num_experts:
            raise ConfigError(f"{source} holds experts {sorted(by_index)} of {name}, but the model config has "
                              f"{cfg.num_experts} (model.num_experts); an expert-parallel save's other ranks are missing, "
                              "or the setting differs from the checkpoint's")
        out[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


_HINTS = (
    (".bias", "--model.add-bias-linear"), ("position_embeddings", "--model.position-embedding-type"),
    ("mtp.", "--model.mtp-num-layers"), ("router", "--model.num-experts and --model.moe-layer-freq"),
    ("experts", "--model.num-experts and --model.moe-layer-freq"), ("linear_q", "--model.multi-latent-attention"),
    ("linear_kv", "--model.multi-latent-attention"), ("linear_qkv", "--model.multi-latent-attention"),
    ("layernorm", "--model.qk-layernorm and --model.normalization"), ("output_layer", "--model.tie-embeddings"),
)
"""Which settings decide whether a Megatron tensor exists (a name part -> the flags)."""


def _hint(name: str) -> str:
    flags = next((flags for part, flags in _HINTS if part in name), None)
    return f" ({flags} decide whether {name} exists)" if flags else ""


def from_megatron_layers(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> PyTree:
    """lmfunc params (fp32, ``cfg``'s tree; stacked with ``scan_layers``) from a Megatron
    ``GPTModel`` state dict in any spelling. Every tensor lmfunc needs must be there with the shape
    ``cfg`` implies, and every model tensor there must have a place in ``cfg``'s model: the first
    that is missing, disagrees or is left over is named, with ``source``."""
    check_megatron_mappable(cfg, source)
    named = _canonical(tensors, cfg, source)
    shapes = param_shapes(dataclasses.replace(cfg, scan_layers=False))
    like = dict(flatten_with_paths(shapes))
    leaves: dict[str, torch.Tensor] = {}
    for rule in _model_rules(cfg):
        if not all(name in like for name in rule.ours):
            continue
        shape = tuple(rule.fuse(*(torch.empty(like[name].shape, device="meta") for name in rule.ours)).shape)
        what = "/".join(rule.ours)
        if rule.theirs not in named:
            raise ConfigError(f"{source} has no tensor {rule.theirs} (any spelling), which the model config needs for "
                              f"{what}; check the model settings against the checkpoint's{_hint(rule.theirs)}")
        tensor = named.pop(rule.theirs)
        if tuple(tensor.shape) != shape:
            raise ConfigError(f"{source}: {rule.theirs} has shape {tuple(tensor.shape)}, but the model config implies "
                              f"{shape} for {what}; check the model settings against the checkpoint's")
        for name, part in zip(rule.ours, rule.split(tensor)):
            # A copy: a torch_dist save's layers are views of one stacked tensor, and a training
            # step that updates its state in place needs every leaf in a storage of its own.
            leaves[name] = part.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if cfg.tie_embeddings:
        named.pop("output_layer.weight", None)  # a tied model's last pipeline stage may keep the shared table
    if named:
        left = sorted(named)
        raise ConfigError(f"{source} holds {len(left)} tensor(s) the model config has no place for, first {left[0]}; "
                          f"check the model settings against the checkpoint's{_hint(left[0])}")
    params = tree_unflatten_as(shapes, [leaves[name] for name in like])
    return stack_layers(params) if cfg.scan_layers else params
