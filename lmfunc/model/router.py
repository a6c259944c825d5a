"""The MoE router as pure functions (Megatron's ``moe_utils`` / ``router`` semantics).

A router scores every token against every expert (``route``): softmax or sigmoid scores, the top-k
experts per token, optionally within the best groups of experts, with DeepSeek-V3's aux-loss-free
bias steering the choice but not the weights. Its losses (``load_balancing_loss``,
``sequence_load_balancing_loss``, ``router_z_loss``) are values the caller adds to the gradient;
``updated_expert_bias`` is the bias's once-per-step update, a state change without a gradient.

Shapes: T tokens (batch and sequence flattened), E experts, k experts per token.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch

ROUTER_LOSSES = ("aux_loss", "seq_aux_loss", "z_loss")
"""The router losses ``RouterStats.losses`` holds, in order (Megatron's names)."""

ScoreFunction = Literal["softmax", "sigmoid"]


class Routing(NamedTuple):
    """The router's choice for T tokens: ``weights`` ``[T, k]`` (fp32) that scale each chosen
    expert's output, and ``experts`` ``[T, k]`` (int64) the chosen experts."""

    weights: torch.Tensor
    experts: torch.Tensor


def one_hot_any(indices: torch.Tensor, classes: int) -> torch.Tensor:
    """The map ``[T, classes]`` (bool) of the ``indices`` ``[T, k]`` each row holds."""
    return (indices[:, :, None] == torch.arange(classes, device=indices.device)).any(dim=1)


def take(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``values.gather(1, indices)`` for ``values`` ``[T, E]`` and ``indices`` ``[T, k]``: ``[T, k]``,
    written as a masked sum over the E values, so its backward is a product, not a scatter into a
    zero-filled buffer. torch 2.13's Inductor schedules a reader of such a scatter's result (the
    top-k or gather backward of the routing weights) before the scatter itself when the router
    losses' gradient joins it, silently dropping the routing weights' part of the router gradient
    (``tests/test_moe.py`` compiles the router's gradient against eager)."""
    mask = indices[:, :, None] == torch.arange(values.shape[-1], device=values.device)
    return (values[:, None, :] * mask).sum(dim=-1)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores`` ``[T, E]`` among the experts of each token's best ``group_topk`` of
    ``num_groups`` equal groups, a group scored by the sum of its ``topk // group_topk`` highest
    scores (DeepSeek's device/node-limited routing). Returns values and indices ``[T, topk]``."""
    tokens, experts = scores.shape
    if experts % num_groups or topk % group_topk or group_topk > num_groups:
        raise ValueError(f"group-limited routing needs the experts ({experts}) divisible by the groups ({num_groups}), "
                         f"topk ({topk}) divisible by the chosen groups ({group_topk}), and group_topk <= num_groups")
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = one_hot_any(group_scores.topk(group_topk, dim=-1).indices, num_groups)
    allowed = chosen[:, :, None].expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def route(logits: torch.Tensor, topk: int, score_function: ScoreFunction = "softmax", pre_softmax: bool = False,
          expert_bias: Optional[torch.Tensor] = None, num_groups: Optional[int] = None,
          group_topk: Optional[int] = None, scaling_factor: Optional[float] = None) -> Routing:
    """The top-k experts of each token from router ``logits`` ``[T, E]`` (Megatron's
    ``topk_routing_with_score_function``), all in fp32:

    - softmax: the top-k logits, softmax over those k (with ``pre_softmax``: softmax over all E
      first, then the top-k of the probabilities, not renormalised);
    - sigmoid: the top-k of ``sigmoid(logits) + expert_bias`` (the bias, DeepSeek-V3's aux-loss-free
      balancing, only steers the choice), weighted by their sigmoid scores normalised to sum to 1
      when k > 1;
    - with ``group_topk``, the choice is limited to the best groups (``group_limited_topk``);
    - ``scaling_factor`` multiplies the weights.
    """
    logits = logits.float()

    def choose(scores: torch.Tensor) -> torch.Tensor:
        """The chosen experts ``[T, k]`` of ``scores`` (no gradient flows through the top-k)."""
        if group_topk:
            return group_limited_topk(scores.detach(), topk, num_groups, group_topk)[1]
        return scores.detach().topk(topk, dim=-1).indices

    def top(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts of ``scores`` and their values (``take``)."""
        experts = choose(scores)
        return take(scores, experts), experts

    if score_function == "softmax":
        if expert_bias is not None:
            raise ValueError("the expert bias (aux-loss-free balancing) steers sigmoid scores; use score_function 'sigmoid'")
        if pre_softmax:
            weights, experts = top(torch.softmax(logits, dim=-1))
        else:
            top_logits, experts = top(logits)
            weights = torch.softmax(top_logits, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            experts = choose(scores + expert_bias.float())
            weights = take(scores, experts)
        else:
            weights, experts = top(scores)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    if scaling_factor:
        weights = weights * scaling_factor
    return Routing(weights, experts)


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: ScoreFunction) -> tuple[torch.Tensor, torch.Tensor]:
    """What the load-balancing losses read, from router ``logits`` ``[T, E]``: every expert's score
    ``[T, E]`` (softmax, or sigmoid normalised over the experts) and the map ``[T, E]`` (bool) of
    each token's top-k experts by that score (Megatron's ``compute_routing_scores_for_aux_loss``:
    without the expert bias or group limits)."""
    logits = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = one_hot_any(scores.topk(topk, dim=-1).indices, scores.shape[-1])
    return scores, chosen


def load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """The Switch/GShard load-balancing loss ``coeff * E * sum_i f_i * P_i`` over T tokens:
    ``f_i`` the fraction of the T * k choices that went to expert i (``routing_map`` ``[T, E]``),
    ``P_i`` expert i's mean score (``scores`` ``[T, E]``)."""
    return balancing_loss_of_sums(scores.sum(dim=0), routing_map.float().sum(dim=0), scores.shape[0], topk, coeff)


def balancing_loss_of_sums(score_sums: torch.Tensor, load: torch.Tensor, tokens: int, topk: int,
                           coeff: float) -> torch.Tensor:
    """``load_balancing_loss`` from its two sums over the T tokens: every expert's summed score
    ``[E]`` and its choices ``[E]`` (where the tokens are split over ranks, both summed over all
    of them first: the loss is not a sum of per-rank parts)."""
    return (score_sums * load).sum() * (score_sums.shape[-1] * coeff / (topk * tokens * tokens))


def sequence_load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int,
                                 coeff: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-level balance loss: ``load_balancing_loss`` within each sequence of
    ``scores`` and ``routing_map`` ``[B, S, E]``, averaged over the B sequences."""
    return sequence_balancing_loss_of_sums(scores.sum(dim=1), routing_map.float().sum(dim=1), scores.shape[1], topk,
                                           coeff)


def sequence_balancing_loss_of_sums(score_sums: torch.Tensor, load: torch.Tensor, seq: int, topk: int,
                                    coeff: float) -> torch.Tensor:
    """``sequence_load_balancing_loss`` from its sums over each sequence of ``seq`` tokens: every
    expert's summed score ``[B, E]`` and its choices ``[B, E]`` (where a sequence is split over
    ranks, summed over all of them first)."""
    per_sequence = (score_sums * load).sum(dim=-1) * (score_sums.shape[-1] * coeff / (topk * seq * seq))
    return per_sequence.mean()


def router_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's z-loss: ``coeff * mean_t logsumexp(logits_t)^2`` over the tokens of ``logits``
    ``[T, E]``; it keeps the router's logits small."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


def tokens_per_expert(experts: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How many (token, expert) pairs of ``experts`` ``[T, k]`` each of ``num_experts`` experts
    receives ``[E]`` (fp32), counting only the ``keep`` ``[T, k]`` pairs when given."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=experts.device)
    ones = torch.ones(experts.shape, dtype=torch.float32, device=experts.device)
    return counts.index_add(0, experts.reshape(-1), (ones if keep is None else keep.float()).reshape(-1))


def updated_expert_bias(expert_bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing step: ``bias + rate * sign(mean(load) - load)``: an
    expert that received fewer pairs than the mean (``load`` ``[E]``, summed over the step and the
    data-parallel ranks) gets a higher bias, a busier one a lower."""
    return expert_bias + rate * torch.sign(load.mean() - load).to(expert_bias.dtype)
