"""Learning-rate schedules with Megatron's formulas (``OptimizerParamScheduler.get_lr``).

A schedule maps the number of completed optimizer steps ``n`` (an integer tensor) to a learning
rate (an fp32 scalar tensor) using only tensor ops, so the compiled step never recompiles or
breaks on it. Megatron counts these steps in samples; lmfunc counts optimizer steps (for a
fixed global batch the two differ only by the factor ``global_batch_size``). As in Megatron,
the first update (``n = 0``) runs at ``warmup_init`` when there is a warmup.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from lmfunc.optim.transforms import Schedule

DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSDDecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]


def _wsd_factor(q: torch.Tensor, style: WSDDecayStyle) -> torch.Tensor:
    if style == "linear":
        return 1.0 - q
    if style == "cosine":
        return 0.5 * (torch.cos(math.pi * q) + 1.0)
    if style == "exponential":
        return 2.0 * torch.pow(0.5, q) - 1.0
    return 1.0 - torch.sqrt(q)


def warmup_decay_schedule(
    max_lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    decay_steps: Optional[int] = None,
    decay_style: DecayStyle = "cosine",
    warmup_init: float = 0.0,
    wsd_decay_steps: int = 0,
    wsd_decay_style: WSDDecayStyle = "exponential",
) -> Schedule:
    """Linear warmup from ``warmup_init`` to ``max_lr`` over ``warmup_steps``, then decay to
    ``min_lr`` at ``decay_steps`` (counted from step 0, warmup included) and ``min_lr`` after.

    With r = (n - W) / (D - W): linear ``1 - r``; cosine ``(cos(pi r) + 1) / 2``;
    inverse-square-root ``max(min, max * sqrt(max(W, 1)) / sqrt(max(n, 1)))``; WSD holds
    ``max_lr`` until ``D - wsd_decay_steps`` and then decays with ``wsd_decay_style``.
    """
    if decay_style not in ("constant", "linear", "cosine", "inverse-square-root", "WSD"):
        raise ValueError(
            f"unknown lr decay_style {decay_style!r}; use constant, linear, cosine, inverse-square-root or WSD"
        )
    if decay_steps is None:
        if decay_style not in ("constant", "inverse-square-root"):
            raise ValueError(f"lr decay_style {decay_style!r} needs decay_steps (usually the number of training steps)")
        decay_steps = warmup_steps
    if warmup_steps < 0 or decay_steps < warmup_steps:
        raise ValueError(
            f"lr warmup_steps ({warmup_steps}) must be between 0 and decay_steps ({decay_steps}); "
            "shorten the warmup or lengthen the decay"
        )
    if decay_style == "WSD" and not 0 < wsd_decay_steps <= decay_steps:
        raise ValueError(f"WSD needs 0 < wsd_decay_steps ({wsd_decay_steps}) <= decay_steps ({decay_steps})")
    if decay_style == "WSD" and wsd_decay_style not in ("linear", "cosine", "exponential", "minus_sqrt"):
        raise ValueError(f"unknown wsd_decay_style {wsd_decay_style!r}; use linear, cosine, exponential or minus_sqrt")
    span = max(decay_steps - warmup_steps, 1)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        n = torch.as_tensor(count).to(torch.float64)
        if decay_style == "constant":
            decayed = torch.full_like(n, max_lr)
        elif decay_style == "inverse-square-root":
            decayed = torch.clamp(max_lr * math.sqrt(max(warmup_steps, 1)) / torch.sqrt(torch.clamp(n, min=1.0)), min=min_lr)
        else:
            if decay_style == "WSD":
                anneal_start = decay_steps - wsd_decay_steps
                q = torch.clamp((n - anneal_start) / wsd_decay_steps, 0.0, 1.0)
                coeff = torch.where(n <= anneal_start, torch.ones_like(n), _wsd_factor(q, wsd_decay_style))
            else:
                r = torch.clamp((n - warmup_steps) / span, 0.0, 1.0)
                coeff = 1.0 - r if decay_style == "linear" else 0.5 * (torch.cos(math.pi * r) + 1.0)
            decayed = min_lr + coeff * (max_lr - min_lr)
        if decay_style != "constant":
            decayed = torch.where(n > decay_steps, torch.full_like(n, min_lr), decayed)
        if warmup_steps > 0:
            warm = warmup_init + (max_lr - warmup_init) * n / warmup_steps
            decayed = torch.where(n <= warmup_steps, warm, decayed)
        return decayed.to(torch.float32)

    return schedule
