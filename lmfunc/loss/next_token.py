"""Language-model losses. Logits are upcast to fp32 inside the loss.

Losses return sums of token losses and token counts rather than means, so that microbatches and
data-parallel ranks can be summed first and divided once by the global token count — Megatron's
``sum(loss * mask) / sum(mask)``. Multi-token-prediction losses ride along in ``LossOutput`` and
reach the gradient through ``attach_aux_loss``, as Megatron's ``MTPLossAutoScaler`` does.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from torch.distributed.tensor import DTensor

from lmfunc import model
from lmfunc.config import ModelConfig
from lmfunc.grad import attach_aux_loss
from lmfunc.loss.chunked_output import chunked_output_layer_loss
from lmfunc.loss.vocab_parallel import vocab_parallel_cross_entropy
from lmfunc.model import mtp
from lmfunc.model.layers import upcast
from lmfunc.model.moe import RouterStats
from lmfunc.parallel.context import is_context_parallel
from lmfunc.parallel.placement import is_vocab_parallel, linear


def masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of ``logits`` ``[..., V]`` against ``labels`` ``[...]`` weighted by ``loss_mask``.

    Returns ``(sum over tokens of mask * loss, sum of mask)`` as scalars; the mean is their
    ratio. Without a mask every token counts. Logits are upcast to at least fp32 first.
    """
    if is_context_parallel(logits):
        return _sequence_split_cross_entropy(upcast(logits), labels, loss_mask)
    flat, flat_labels = upcast(logits).flatten(0, -2), labels.flatten()
    if is_vocab_parallel(logits):
        per_token = vocab_parallel_cross_entropy(flat, flat_labels)
    else:
        per_token = F.cross_entropy(flat, flat_labels, reduction="none")
    if loss_mask is None:
        count = torch.tensor(float(per_token.numel()), dtype=per_token.dtype, device=per_token.device)
        return per_token.sum(), count
    mask = loss_mask.flatten().to(per_token.dtype)
    return (per_token * mask).sum(), mask.sum()


def _sequence_split_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                  loss_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_cross_entropy`` of logits ``[B, S, V]`` whose sequence is split over ``cp``, without
    flattening ``[B, S]`` (a DTensor split along S cannot be flattened into B x S without gathering
    it): the cross entropy of ``[B, V, S]``, vocab-parallel when the vocabulary is split over ``tp``."""
    if is_vocab_parallel(logits):
        per_token = vocab_parallel_cross_entropy(logits.transpose(1, 2), labels)
    else:
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    if loss_mask is None:
        count = torch.tensor(float(per_token.numel()), dtype=per_token.dtype, device=labels.to_local().device)
        return per_token.sum(), count
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum(), mask.sum()


def output_layer_loss(
    params: model.gpt.Params, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
    cfg: ModelConfig, grad_hint: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_cross_entropy(model.logits(params, hidden, cfg), labels, loss_mask)``; in chunks of
    ``cfg.cross_entropy_chunk_tokens`` tokens (``lmfunc.loss.chunked_output``, with ``grad_hint``, the
    gradient the loss sum will receive) unless that is 0 or the head is a DTensor (tensor parallel
    or FSDP: vocab-parallel cross entropy on the full logits)."""
    weight = model.gpt.output_weight(params, cfg)
    if cfg.cross_entropy_chunk_tokens > 0 and not isinstance(weight, DTensor) and not isinstance(hidden, DTensor):
        return chunked_output_layer_loss(hidden, weight, labels, loss_mask, cfg.cross_entropy_chunk_tokens, grad_hint)
    return masked_cross_entropy(linear(hidden, weight), labels, loss_mask)


class LossOutput(NamedTuple):
    """Sums and counts of one batch. ``mtp_loss_sums``/``mtp_num_tokens`` are ``[D]`` (empty
    without multi-token prediction); the per-token mean of depth k is their ratio. With MoE layers,
    ``router`` holds their ``RouterStats`` stacked over the layers (``model.moe.moe_layer_names``
    order): ``load`` ``[L_moe, E]``, ``losses`` ``[L_moe, 3]``, ``dropped`` ``[L_moe]``; None
    for a dense model."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    mtp_loss_sums: torch.Tensor
    mtp_num_tokens: torch.Tensor
    router: Optional[RouterStats] = None


def mtp_aux_loss(
    mtp_loss_sums: torch.Tensor, mtp_num_tokens: torch.Tensor, num_tokens: torch.Tensor, cfg: ModelConfig,
    calculate_per_token_loss: bool,
) -> torch.Tensor:
    """Megatron's MTP objective of one microbatch: ``(factor / D) * sum_k loss_k``.

    ``loss_k`` is the depth's per-token mean ``sum_k / max(N_k, 1)``; with
    ``calculate_per_token_loss`` it is rescaled to the main loss's token count,
    ``sum_k * N_0 / max(N_k, 1)``, because the whole objective is then divided by the global N_0.
    """
    weight = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
    per_depth = mtp_loss_sums / torch.clamp(mtp_num_tokens, min=1.0)
    if calculate_per_token_loss:
        per_depth = per_depth * num_tokens
    return weight * per_depth.sum()


def lm_loss_sum(
    params: model.gpt.Params,
    batch: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    dropout_seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of one batch as the pair ``(sum_of_token_losses, num_tokens)`` (no MTP
    depths): the form ``value_and_grad(lm_loss_sum, has_aux=True)`` differentiates.

    ``batch`` holds ``tokens`` and ``labels`` ``[B, S]`` and optionally ``loss_mask``,
    ``position_ids`` and ``doc_ids`` ``[B, S]``.
    """
    out = lm_loss(params, batch, cfg, dropout_seed)
    return out.loss_sum, out.num_tokens


def lm_loss(
    params: model.gpt.Params,
    batch: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    dropout_seed: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    calculate_per_token_loss: bool = True,
) -> LossOutput:
    """Next-token loss of one batch and, when asked for, the multi-token-prediction losses, with
    the MoE layers' router statistics.

    ``batch`` holds ``tokens`` and ``labels`` ``[B, S]`` and optionally ``loss_mask``,
    ``position_ids`` and ``doc_ids`` ``[B, S]``.
    grad_scale: the gradient one unit of the main loss receives (the loss scale times the step's
        normalisation). When given and ``cfg.mtp_num_layers > 0``, the MTP depths run and their
        objective (``mtp_aux_loss``) is attached to the final hidden states with
        ``attach_aux_loss``; without it (evaluation) the MTP depths are skipped. The MoE layers'
        router losses receive ``router_grad_scale``. It is also the range hint of the chunked head
        (``output_layer_loss``).
    """
    decoded = model.gpt.decoder(params, batch["tokens"], cfg, positions=batch.get("position_ids"),
                                doc_ids=batch.get("doc_ids"), dropout_seed=dropout_seed,
                                aux_grad_scale=router_grad_scale(batch["tokens"].numel(), grad_scale,
                                                                 calculate_per_token_loss))
    out = lm_loss_of_hidden(params, decoded.hidden, batch, cfg, dropout_seed, grad_scale, calculate_per_token_loss)
    if not decoded.router_stats:
        return out
    router = stacked_router_stats(decoded.router_stats)
    if out.router is not None:
        router = RouterStats(*(torch.cat(pair) for pair in zip(router, out.router)))
    return out._replace(router=router)


def stacked_router_stats(stats: list[RouterStats]) -> RouterStats:
    """Per-layer ``RouterStats`` stacked into one with a leading layer dim."""
    return RouterStats(*(torch.stack(field) for field in zip(*stats)))


def router_grad_scale(microbatch_tokens: int, grad_scale: Optional[torch.Tensor],
                      calculate_per_token_loss: bool) -> Optional[torch.Tensor]:
    """The gradient of one unit of a microbatch's router loss, given ``grad_scale`` (the step's
    gradient of one unit of its main loss): the same, times the microbatch's B * S tokens
    (``microbatch_tokens``, over all ranks) with ``calculate_per_token_loss`` (where ``grad_scale``
    holds 1 / the batch's loss tokens). Megatron does the same, so the router losses weigh as the
    mean over microbatches and data-parallel ranks of each microbatch's loss either way."""
    if grad_scale is None or not calculate_per_token_loss:
        return grad_scale
    return grad_scale * microbatch_tokens


def lm_loss_of_hidden(
    params: model.gpt.Params,
    hidden: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    dropout_seed: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    calculate_per_token_loss: bool = True,
) -> LossOutput:
    """``lm_loss`` from the final hidden states ``[B, S, h]`` (``model.forward``'s output): the output
    layer, the cross entropy and the MTP depths; the last pipeline stage's part. Arguments as
    ``lm_loss``; MTP reads ``batch["tokens"]``."""
    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch.get("loss_mask")
    grad_hint = grad_scale
    if grad_hint is not None and not calculate_per_token_loss:
        count = loss_mask.to(torch.float32).sum() if loss_mask is not None else torch.tensor(float(labels.numel()), device=labels.device)
        grad_hint = grad_hint / torch.clamp(count, min=1.0)
    positions, doc_ids = batch.get("position_ids"), batch.get("doc_ids")
    mtp_sums, mtp_counts = [], []
    if cfg.mtp_num_layers > 0 and grad_scale is not None:
        mask = loss_mask.to(torch.float32) if loss_mask is not None else torch.ones_like(labels, dtype=torch.float32)
        depth_labels, depth_mask, main_count = labels, mask, mask.sum()
        # d(objective)/d(depth k's loss sum), as mtp_aux_loss defines the objective
        aux_grad = grad_scale * (cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers)
        if calculate_per_token_loss:
            aux_grad = aux_grad * main_count
        depth_hidden, router_stats = mtp.forward(params, hidden, tokens, cfg, positions, doc_ids, dropout_seed,
                                                 router_grad_scale(batch["tokens"].numel(), grad_scale,
                                                                   calculate_per_token_loss))
        for h in depth_hidden:
            depth_labels, depth_mask = mtp.roll_left(depth_labels), mtp.roll_left(depth_mask)
            depth_hint = aux_grad / torch.clamp(depth_mask.sum(), min=1.0)
            depth_sum, depth_count = output_layer_loss(params, h, depth_labels, depth_mask, cfg, depth_hint)
            mtp_sums.append(depth_sum)
            mtp_counts.append(depth_count)
        sums, counts = torch.stack(mtp_sums), torch.stack(mtp_counts)
        aux = mtp_aux_loss(sums, counts, main_count, cfg, calculate_per_token_loss)
        hidden = attach_aux_loss(hidden, aux, grad_scale)
    loss_sum, num_tokens = output_layer_loss(params, hidden, labels, loss_mask, cfg, grad_hint)
    if not mtp_sums:
        return LossOutput(loss_sum, num_tokens, loss_sum.new_zeros(0), loss_sum.new_zeros(0))
    router = stacked_router_stats(router_stats) if router_stats else None
    return LossOutput(loss_sum, num_tokens, sums, counts, router)
