"""Mixture-of-experts layers as pure functions (Megatron's ``moe_utils`` semantics); the router's
choice and losses are ``lmfunc.model.router``'s.

The experts are SwiGLU MLPs stacked along a leading expert dim. ``experts_dropless`` sends every
(token, expert) pair to its expert: the pairs sorted by expert, one grouped matmul per projection
(``grouped_mm``: ``torch._grouped_mm`` as a custom op with its own backward, so it compiles in every
dtype; a loop over experts for dtypes the kernel lacks). ``experts_with_capacity`` gives
every expert a fixed number of slots (``expert_capacity``) and drops the pairs beyond them with
Megatron's policies ("probs": an expert keeps its highest-weighted pairs; "position": its earliest
tokens), so every shape is static.

``moe_mlp`` is the layer that replaces a block's MLP: the router (``router.weight`` ``[h, E]``,
``router.expert_bias`` ``[E]``), the routed experts (``experts.{w_gate, w_up}`` ``[E, h, f]``,
``experts.w_out`` ``[E, f, h]``) and optional shared experts (a dense SwiGLU MLP every token passes
through). Its router losses join the gradient through ``attach_aux_loss`` on the layer's output
(Megatron's ``MoEAuxLossAutoScaler``); its ``RouterStats`` leave the model for the metrics and the
expert-bias update.

Shapes: T tokens (batch and sequence flattened), h hidden, E experts, k experts per token, f the
expert MLP width.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Optional

import torch
import torch.nn.functional as F

from lmfunc.compiler.torch_compat.tensors import grouped_mm as torch_grouped_mm
from lmfunc.config import ModelConfig
from lmfunc.grad import attach_aux_loss
from lmfunc.model import layers
from lmfunc.model.router import (ROUTER_LOSSES, Routing, aux_loss_scores, balancing_loss_of_sums, route,
                                 router_z_loss, sequence_balancing_loss_of_sums, tokens_per_expert,
                                 updated_expert_bias)
from lmfunc.parallel.expert_parallel import (ExpertGroup, combine_slots, combine_sorted, dispatch_slots,
                                              dispatch_sorted, expert_group)
from lmfunc.parallel.placement import (gather, gather_experts, linear, replicated, rows_as_tokens, run_on_tokens,
                                       tokens_as_rows)

DropPolicy = Literal["probs", "position"]


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert for ``num_tokens`` tokens (Megatron's ``get_capacity`` of the T * k pairs):
    ``ceil(T * k / E * capacity_factor)``."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def queue_positions(routing: Routing, num_experts: int, policy: DropPolicy) -> torch.Tensor:
    """Each (token, expert) pair's place ``[T, k]`` (int64, from 0) in its expert's queue: by
    descending weight ("probs") or by token order ("position"). Pairs of equal weight queue by
    token order (a stable sort), so a full expert keeps the earliest of them; Megatron orders them
    with ``torch.topk`` over equal values, whose choice among ties is unspecified."""
    experts = routing.experts.reshape(-1)
    pairs = torch.arange(experts.numel(), device=experts.device)
    if policy == "probs":
        pairs = torch.argsort(-routing.weights.reshape(-1), stable=True)
    elif policy != "position":
        raise ValueError(f"drop policy must be 'probs' or 'position', got {policy!r}")
    order = pairs[torch.argsort(experts[pairs], stable=True)]
    counts = _counts(experts, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.empty_like(experts)
    positions[order] = torch.arange(experts.numel(), device=experts.device) - starts[experts[order]]
    return positions.reshape(routing.experts.shape)


def _counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert ``[E]`` (int64) of the flat expert indices ``experts`` (a static shape,
    unlike ``bincount``'s)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=experts.device).index_add(
        0, experts, torch.ones_like(experts))


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, matmul) -> torch.Tensor:
    return matmul(F.silu(matmul(x, w_gate)) * matmul(x, w_up), w_down)


def experts_with_capacity(x: torch.Tensor, routing: Routing, w_gate: torch.Tensor, w_up: torch.Tensor,
                          w_down: torch.Tensor, capacity: int, policy: DropPolicy = "probs",
                          ep: Optional[ExpertGroup] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted sum of each token's experts for tokens ``x`` ``[T, h]``, experts ``w_gate``,
    ``w_up`` ``[E, h, f]`` and ``w_down`` ``[E, f, h]``, each expert taking at most ``capacity``
    pairs (``queue_positions`` decides which; the others are dropped, contributing nothing).
    Static shapes: every expert runs on a ``[capacity, h]`` buffer. With ``ep`` the weights are this
    rank's ``E / ep`` experts and the buffers travel to their experts' ranks and back
    (``dispatch_slots``). Returns ``[T, h]`` and the kept pairs ``[T, k]`` (bool)."""
    tokens, hidden = x.shape
    num_experts = w_gate.shape[0] * (ep.size if ep is not None else 1)
    positions = queue_positions(routing, num_experts, policy)
    keep = positions < capacity
    slot = torch.where(keep, routing.experts * capacity + positions, num_experts * capacity)  # dropped: a spare slot
    token = torch.arange(tokens, device=x.device)[:, None].expand_as(slot).reshape(-1)
    buffer = x.new_zeros(num_experts * capacity + 1, hidden).index_copy(0, slot.reshape(-1), x[token])
    buffer = buffer[:-1].view(num_experts, capacity, hidden)
    if ep is None:
        out = _swiglu(buffer, w_gate, w_up, w_down, torch.bmm)
    else:
        out = combine_slots(_swiglu(dispatch_slots(buffer, ep), w_gate, w_up, w_down, torch.bmm), ep)
    out = torch.cat([out.reshape(-1, hidden), out.new_zeros(1, hidden)])[slot.reshape(-1)]
    weights = (routing.weights * keep).reshape(-1, 1).to(out.dtype)
    return x.new_zeros(tokens, hidden).index_add(0, token, out * weights), keep


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes that ``torch._grouped_mm`` takes (eagerly; others loop over the groups)."""


@torch.library.custom_op("lmfunc::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[T, K]`` sorted by group times their group's matrix of ``weights`` ``[E, K, N]``:
    ``[T, N]``, group e owning rows ``ends[e-1]:ends[e]`` (``ends`` ``[E]`` int32 cumulative).
    One ``torch._grouped_mm`` for ``GROUPED_DTYPES``, a loop over the groups otherwise. A custom op,
    so the compiled step calls the same kernel as eager code whatever the dtype: the kernel's
    tracing rule takes bf16 only."""
    if rows.dtype in GROUPED_DTYPES:
        return torch_grouped_mm(rows.contiguous(), weights, offs=ends)
    starts = [0] + ends.tolist()[:-1]
    return torch.cat([rows[a:b] @ weights[e] for e, (a, b) in enumerate(zip(starts, ends.tolist()))])


@grouped_mm.register_fake
def _grouped_mm_shape(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weights.shape[-1])


@torch.library.custom_op("lmfunc::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(rows: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The gradient of ``grouped_mm``'s weights ``[E, K, N]``: group e's ``rows[group].T @
    grad[group]`` for ``rows`` ``[T, K]`` and ``grad`` ``[T, N]`` (zero for an empty group)."""
    if rows.dtype in GROUPED_DTYPES:
        return torch_grouped_mm(rows.t(), grad.contiguous(), offs=ends)
    starts = [0] + ends.tolist()[:-1]
    return torch.stack([rows[a:b].t() @ grad[a:b] for a, b in zip(starts, ends.tolist())])


@grouped_mm_weight_grad.register_fake
def _grouped_mm_weight_grad_shape(rows: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(ends.shape[0], rows.shape[1], grad.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    rows, weights, ends = inputs
    ctx.save_for_backward(rows, weights, ends)


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    rows, weights, ends = ctx.saved_tensors
    grad = grad.contiguous()  # the kernel refuses stride-0 gradients (a sum's, expanded)
    return grouped_mm(grad, weights.transpose(1, 2), ends), grouped_mm_weight_grad(rows, grad, ends), None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def experts_dropless(x: torch.Tensor, routing: Routing, w_gate: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor, ep: Optional[ExpertGroup] = None) -> torch.Tensor:
    """The weighted sum of each token's experts for tokens ``x`` ``[T, h]`` (weights as in
    ``experts_with_capacity``), every pair kept: the pairs sorted by expert and each projection one
    grouped matmul over the experts' row ranges (``grouped_mm``), eager and compiled alike. With
    ``ep`` the weights are this rank's ``E / ep`` experts and the sorted rows travel to their
    experts' ranks and back (``dispatch_sorted``). Returns ``[T, h]``."""
    tokens, hidden = x.shape
    experts = routing.experts.reshape(-1)
    order = torch.argsort(experts, stable=True)
    token = torch.div(order, routing.experts.shape[1], rounding_mode="floor")
    counts = _counts(experts, w_gate.shape[0] * (ep.size if ep is not None else 1))
    rows = x[token]
    if ep is not None:
        rows, counts, dispatched = dispatch_sorted(rows, counts, ep)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    out = _swiglu(rows, w_gate, w_up, w_down, lambda a, w: grouped_mm(a, w, ends))
    if ep is not None:
        out = combine_sorted(out, dispatched, ep)
    weights = routing.weights.reshape(-1)[order].reshape(-1, 1).to(out.dtype)
    return x.new_zeros(tokens, hidden).index_add(0, token, out * weights)


class RouterStats(NamedTuple):
    """What one MoE layer's router did on one microbatch: ``load`` ``[E]`` (fp32) the pairs each
    expert took (after drops), ``losses`` ``[3]`` (fp32) the ``ROUTER_LOSSES`` without their
    coefficients (all three are computed, whichever are in the objective), ``dropped`` the pairs
    the capacity dropped (fp32 scalar). Leading dims are added when layers or microbatches are
    stacked."""

    load: torch.Tensor
    losses: torch.Tensor
    dropped: torch.Tensor


def router_loss_weights(cfg: ModelConfig) -> tuple[float, float, float]:
    """The coefficient of each of ``ROUTER_LOSSES`` in the objective (0 when off)."""
    balancing = cfg.moe_router_load_balancing_type
    return (cfg.moe_aux_loss_coeff if balancing == "aux_loss" else 0.0,
            cfg.moe_aux_loss_coeff if balancing == "seq_aux_loss" else 0.0,
            cfg.moe_z_loss_coeff or 0.0)


def moe_mlp(p: dict, x: torch.Tensor, cfg: ModelConfig,
            aux_grad_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, RouterStats]:
    """The MoE layer ``[B, S, h] -> [B, S, h]`` on tokens ``x``: routing (``route`` with the
    config's score function, top-k, groups, scaling and expert bias), the routed experts (dropless,
    or with ``moe_expert_capacity_factor``'s capacity over the microbatch's tokens on this rank, as
    Megatron's, and ``moe_token_drop_policy``), plus the shared experts. On a mesh with an ``ep`` dim
    each rank runs its ``E / ep`` experts on the pairs every rank routes to them
    (``lmfunc.parallel.expert_parallel``). On a mesh every rank routes its own tokens (its part of
    the batch and, over ``cp``, of each sequence: ``tokens_as_rows``); the router losses are made of
    sums over all of them. With ``aux_grad_scale`` the weighted router
    losses (``router_loss_weights``) receive that gradient; returns the output and ``RouterStats``."""
    batch, seq, hidden = x.shape
    flat = tokens_as_rows(x)
    router = p["router"]
    sequence_logits = linear(x, gather(router["weight"]))
    logits = tokens_as_rows(sequence_logits)
    bias = router.get("expert_bias")
    routing = route(logits, cfg.moe_router_topk, cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
                    None if bias is None else gather(bias), cfg.moe_router_num_groups, cfg.moe_router_group_topk,
                    cfg.moe_router_topk_scaling_factor)
    num_experts = logits.shape[-1]
    weights = [gather_experts(p["experts"][name]) for name in ("w_gate", "w_up", "w_out")]
    ep = expert_group(flat)
    if cfg.moe_expert_capacity_factor is None:
        out = run_on_tokens(lambda t, w, e, *ws: experts_dropless(t, Routing(w, e), *ws, ep=ep),
                            flat, routing.weights, routing.experts, *weights)
        keep = None
    else:
        def capped(t, w, e, *ws):
            capacity = expert_capacity(t.shape[0], num_experts, cfg.moe_router_topk, cfg.moe_expert_capacity_factor)
            return experts_with_capacity(t, Routing(w, e), *ws, capacity, cfg.moe_token_drop_policy, ep=ep)

        out, keep = run_on_tokens(capped, flat, routing.weights, routing.experts, *weights, per_token=2)

    def loss_sums(t: torch.Tensor):
        """Sums over one rank's tokens ``t`` ``[b, s, E]`` (its part of the batch and of each
        sequence) that the router losses are made of: every expert's scores and choices, in all
        and per sequence, and the squared logsumexps."""
        scores, chosen = aux_loss_scores(t.reshape(-1, num_experts), cfg.moe_router_topk,
                                         cfg.moe_router_score_function)
        scores, chosen = scores.view(t.shape), chosen.view(t.shape).float()
        z_sum = router_z_loss(t.reshape(-1, num_experts), 1.0) * (t.shape[0] * t.shape[1])
        return scores.sum(dim=(0, 1)), chosen.sum(dim=(0, 1)), z_sum, scores.sum(dim=1), chosen.sum(dim=1)

    sums = run_on_tokens(loss_sums, sequence_logits, per_token=0, sums=3, sequence_sums=2)
    score_sums, choices, z_sum, sequence_scores, sequence_choices = map(replicated, sums)
    topk, tokens = cfg.moe_router_topk, batch * seq
    losses = torch.stack([balancing_loss_of_sums(score_sums, choices, tokens, topk, 1.0),
                          sequence_balancing_loss_of_sums(sequence_scores, sequence_choices, seq, topk, 1.0),
                          z_sum / tokens])
    loss_weights = router_loss_weights(cfg)
    if aux_grad_scale is not None and any(loss_weights):
        objective = (losses * torch.tensor(loss_weights, dtype=losses.dtype, device=losses.device)).sum()
        out = attach_aux_loss(out, objective, aux_grad_scale)

    def counts(experts: torch.Tensor, kept: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        load = tokens_per_expert(experts, num_experts, kept)
        return load, (~kept).sum().float() if kept is not None else load.new_zeros(())

    load, dropped = run_on_tokens(counts, routing.experts, keep, per_token=0, sums=2)
    out = rows_as_tokens(out, x)
    if "shared_experts" in p:
        out = out + layers.mlp(p["shared_experts"], x, cfg)
    return out, RouterStats(load.detach(), losses.detach(), dropped)


def feed_forward(p: dict, x: torch.Tensor, cfg: ModelConfig,
                 aux_grad_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[RouterStats]]:
    """A block's MLP part ``[B, S, h] -> [B, S, h]``: ``moe_mlp`` when ``p`` holds a router, the
    dense ``layers.mlp`` otherwise (no stats)."""
    if "router" in p:
        return moe_mlp(p, x, cfg, aux_grad_scale)
    return layers.mlp(p, x, cfg), None


def router_metrics(stats: RouterStats, num_microbatches: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The step's router metrics from ``stats`` summed over its microbatches (``load`` ``[L, E]``,
    ``losses`` ``[L, 3]``, ``dropped`` ``[L]`` over L MoE layers): each router loss in the objective
    (``moe_<name>``, the mean over layers and microbatches, without its coefficient), the pairs per
    expert (``moe_tokens_per_expert_{min,mean,max}`` over every layer's experts), the load imbalance
    (``moe_imbalance``: the largest max / mean of a layer), with a capacity the fraction of pairs
    dropped (``moe_dropped_fraction``), and per layer ``moe_layer_imbalance`` and
    ``moe_layer_<name>`` ``[L]``."""
    losses = stats.losses / num_microbatches
    per_expert_mean = stats.load.mean(dim=-1)
    layer_imbalance = stats.load.amax(dim=-1) / torch.clamp(per_expert_mean, min=1.0)
    metrics = {
        "moe_tokens_per_expert_min": stats.load.amin(), "moe_tokens_per_expert_mean": stats.load.mean(),
        "moe_tokens_per_expert_max": stats.load.amax(), "moe_imbalance": layer_imbalance.amax(),
        "moe_layer_imbalance": layer_imbalance,
    }
    for index, (name, weight) in enumerate(zip(ROUTER_LOSSES, router_loss_weights(cfg))):
        if weight > 0:
            metrics[f"moe_{name}"] = losses[:, index].mean()
            metrics[f"moe_layer_{name}"] = losses[:, index]
    if cfg.moe_expert_capacity_factor is not None:
        routed = stats.load.sum() + stats.dropped.sum()
        metrics["moe_dropped_fraction"] = stats.dropped.sum() / torch.clamp(routed, min=1.0)
    return metrics


def moe_layer_names(cfg: ModelConfig) -> list[str]:
    """Dotted names of the MoE layers' MLP subtrees, in the order their ``RouterStats`` come out of
    ``decoder`` and then ``mtp.forward``: ``layers.<i>.mlp`` ..., ``mtp.<k>.layer.mlp`` ..."""
    names = [f"layers.{i}.mlp" for i, is_moe in enumerate(cfg.moe_layers) if is_moe]
    if cfg.moe_layers[-1]:
        names += [f"mtp.{k}.layer.mlp" for k in range(cfg.mtp_num_layers)]
    return names


def updated_expert_biases(params: dict, load: torch.Tensor, cfg: ModelConfig,
                          layer_names: Optional[list[str]] = None) -> dict:
    """``params`` with every router's ``expert_bias`` moved by DeepSeek-V3's aux-loss-free step
    (``router.updated_expert_bias`` at ``moe_router_bias_update_rate``), ``load`` ``[L, E]`` the
    pairs each expert of each MoE layer of ``layer_names`` (default: all, ``moe_layer_names``
    order; a pipeline rank names those it holds) took over the step. Other leaves are shared;
    without expert biases ``params`` itself."""
    if not cfg.moe_router_enable_expert_bias:
        return params
    new = dict(params)
    names = moe_layer_names(cfg) if layer_names is None else layer_names
    if len(names) != load.shape[0]:
        raise ValueError(f"updated_expert_biases: {load.shape[0]} layers' loads for {len(names)} MoE layers")
    for name, layer_load in zip(names, load.unbind(0)):
        *parents, last = name.split(".")
        node = new
        for key in parents:
            node[key] = dict(node[key])
            node = node[key]
        mlp = dict(node[last])
        router = dict(mlp["router"])
        router["expert_bias"] = updated_expert_bias(router["expert_bias"], layer_load,
                                                        cfg.moe_router_bias_update_rate)
        mlp["router"] = router
        node[last] = mlp
    return new
