"""Gradient underflow: how much of a low-precision backward pass rounds to zero.

fp16's smallest subnormal is 2^-24 (about 6e-8). A gradient element whose true value is smaller
becomes exactly 0 in an fp16 backward pass, and that loss of signal is what loss scaling exists
to prevent: multiplying the loss by ``S`` lifts every gradient by ``S`` before it is rounded.
``gradient_underflow`` measures it directly. At the same parameters and on the same microbatch
it differentiates the objective the train step differentiates (the token-loss sum divided by
the token count, times the loss scale) twice: once in fp32, once in the compute dtype with the
scale. It then counts, per parameter group, the elements that are exactly zero in the
low-precision gradient but not in the fp32 one.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor

from lmfunc.config import ModelConfig
from lmfunc.config.train import TrainConfig
from lmfunc.grad import value_and_grad
from lmfunc.loss import LossOutput, lm_loss
from lmfunc.precision import cast_params, compute_dtype
from lmfunc.tree import PyTree, flatten_with_paths
from lmfunc.train.state import TrainState
from lmfunc.train.step import distributed_context

GROUPS = ("embedding", "attention", "mlp", "norms", "output", "mtp")


def parameter_group(path: str) -> str:
    """The group a dotted parameter path belongs to: ``embedding``, ``attention``, ``mlp``,
    ``norms`` (norm scales and biases), ``output`` (an untied output layer) or ``mtp`` (the
    multi-token-prediction depths)."""
    parts = path.split(".")
    if parts[0] == "mtp":
        return "mtp"
    if parts[0] == "embed":
        return "embedding"
    if parts[0] == "output":
        return "output"
    if any(part.endswith("norm") for part in parts):
        return "norms"
    if "attn" in parts:
        return "attention"
    if "mlp" in parts:
        return "mlp"
    return "norms" if parts[-1] in ("scale", "bias") else "other"


def _count(mask: torch.Tensor) -> torch.Tensor:
    total = mask.sum()
    return total.full_tensor() if isinstance(total, DTensor) else total


def _grads(params: PyTree, microbatch: Mapping[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
           scale: float, loss_fn: Callable[..., LossOutput]) -> dict[str, torch.Tensor]:
    """Gradients of ``loss_sum / num_tokens * scale`` w.r.t. the params cast to ``dtype``, by path."""
    def objective(low_params):
        out = loss_fn(low_params, microbatch, cfg, None, None)
        return out.loss_sum / torch.clamp(out.num_tokens, min=1.0) * scale

    _, grads = value_and_grad(objective)(cast_params(params, dtype))
    return {path: g for path, g in flatten_with_paths(grads) if g is not None}


def gradient_underflow(
    params: PyTree, microbatch: Mapping[str, torch.Tensor], cfg: ModelConfig, compute_dtype: torch.dtype,
    scale: float = 1.0, loss_fn: Callable[..., LossOutput] = lm_loss,
) -> dict[str, float]:
    """Per parameter group (``parameter_group``) and ``"all"``: the fraction of gradient elements
    that are exactly zero in the ``compute_dtype`` gradient of the objective times ``scale`` but
    nonzero in the fp32 gradient, over the group's elements. ``"overflow"`` is the fraction of
    low-precision elements that are not finite (the scale was too large: such a step is skipped).

    microbatch: ``tokens``/``labels`` ``[B, S]`` (and optional ``loss_mask`` etc.), one microbatch.
    Runs eagerly: two forward/backward passes of the microbatch. The main next-token loss only
    (MTP depths are not run), so MTP parameters are not counted.
    """
    reference = _grads(params, microbatch, cfg, torch.float32, 1.0, loss_fn)
    low = _grads(params, microbatch, cfg, compute_dtype, scale, loss_fn)
    lost: dict[str, float] = {}
    sizes: dict[str, int] = {}
    non_finite = 0.0
    for path, ref in reference.items():
        if path not in low:
            continue
        group = parameter_group(path)
        if group == "mtp":
            continue
        underflowed = (low[path] == 0) & (ref != 0)
        lost[group] = lost.get(group, 0.0) + float(_count(underflowed))
        sizes[group] = sizes.get(group, 0) + ref.numel()
        non_finite += float(_count(~torch.isfinite(low[path])))
    total = sum(sizes.values())
    fractions = {group: lost[group] / sizes[group] for group in sizes}
    fractions["all"] = sum(lost.values()) / max(total, 1)
    fractions["overflow"] = non_finite / max(total, 1)
    return fractions


def underflow_at_step(cfg: TrainConfig, state: TrainState, batch: Mapping[str, torch.Tensor], step: int, first: bool,
                      pipelined: bool, echo: Callable[[str], None]) -> Optional[dict[str, float]]:
    """At the run's ``first`` step and every ``log.grad_underflow_interval`` steps of a low-precision
    run: the ``gradient_underflow`` fractions of the step's first microbatch (``batch`` is
    ``[microbatches, B, S]``) at ``state``'s params and loss scale, with ``loss_scale``; else None.
    Not measured under pipeline parallelism (said once through ``echo``): it differentiates the
    whole model on one rank."""
    interval, precision = cfg.log.grad_underflow_interval, cfg.precision
    if interval is None or precision.compute_dtype == "fp32" or (not first and step % interval != 0):
        return None
    if pipelined:
        if first:
            echo("log.grad_underflow_interval: not measured under pipeline parallelism (it differentiates the whole "
                 "model on one rank)")
        return None
    scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
    with distributed_context(state.params):
        fractions = gradient_underflow(state.params, {k: v[0] for k, v in batch.items()}, cfg.model,
                                       compute_dtype(precision.compute_dtype), scale)
    return {"loss_scale": scale, **fractions}
