"""The optimizer and learning-rate schedule of a ``TrainConfig`` (Megatron's ``OptimizerParamScheduler``).

Iteration-based runs schedule over optimizer steps (Megatron's sample counts divided by the fixed
global batch size: the same curve). Sample-based runs schedule over consumed samples, looked up
per step from the run's batch plan, so a batch-size ramp-up gives Megatron's learning rates exactly.
"""

from __future__ import annotations

import torch

from lmfunc.config.train import TrainConfig
from lmfunc.optim import GradientTransformation, adamw, warmup_decay_schedule
from lmfunc.optim.transforms import Schedule
from lmfunc.train.batching import BatchPlan


def build_lr_schedule(cfg: TrainConfig, plan: BatchPlan, train_iters: int) -> Schedule:
    """``lr(step)`` for the run: warmup, then ``optim.lr_decay_style`` down to ``optim.min_lr``."""
    optim, run = cfg.optim, cfg.run
    if run.train_iters is not None:
        decay, warmup, wsd = optim.lr_decay_iters or run.train_iters, optim.lr_warmup_iters, optim.lr_wsd_decay_iters
    else:
        decay, warmup, wsd = optim.lr_decay_samples or run.train_samples, optim.lr_warmup_samples, optim.lr_wsd_decay_samples
    if optim.lr_warmup_fraction is not None:
        warmup = int(optim.lr_warmup_fraction * decay)
    schedule = warmup_decay_schedule(
        optim.lr, optim.min_lr, warmup, decay, optim.lr_decay_style, optim.lr_warmup_init,
        wsd or 0, optim.lr_wsd_decay_style,
    )
    if run.train_iters is not None:
        return schedule
    samples_before = torch.tensor(plan.samples_before_steps(train_iters), dtype=torch.int64)
    last = len(samples_before) - 1

    def schedule_over_samples(step: torch.Tensor) -> torch.Tensor:
        return schedule(samples_before[torch.clamp(torch.as_tensor(step), 0, last)])

    return schedule_over_samples


def build_optimizer(cfg: TrainConfig, lr_schedule: Schedule) -> GradientTransformation:
    """AdamW with ``optim``'s betas, epsilon and decoupled weight decay (matrices only)."""
    optim = cfg.optim
    return adamw(lr_schedule, b1=optim.adam_beta1, b2=optim.adam_beta2, eps=optim.adam_eps,
                 weight_decay=optim.weight_decay)
