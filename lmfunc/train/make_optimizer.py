"""The optimizer and learning-rate schedules of a ``TrainConfig`` (Megatron's ``OptimizerParamScheduler``
and parameter groups).

Iteration-based runs schedule over optimizer steps (Megatron's sample counts divided by the fixed
global batch size: the same curve). Sample-based runs schedule over consumed samples, looked up
per step from the run's batch plan, so a batch-size ramp-up gives Megatron's learning rates exactly.

Parameter groups, as Megatron builds them: no weight decay on 1-D leaves (norm scales, biases) and
optionally none on the embeddings and output layer; ``optim.decoupled_lr``/``decoupled_min_lr``
for the token embedding and the output layer (same warmup and decay); ``optim.lr_mult`` for the
leaves whose dotted names match ``optim.scale_lr_patterns`` (Megatron's ``scale_lr_cond``).
"""

from __future__ import annotations

from typing import Optional

import torch

from lmfunc.config.train import TrainConfig, schedule_lengths
from lmfunc.optim import GradientTransformation, add_decayed_weights, chain, scale_by_adam, warmup_decay_schedule
from lmfunc.optim.partition import multi_transform, name_matches, param_labels
from lmfunc.optim.transforms import Schedule, scale_by_learning_rate
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.tree import PyTree, tree_leaves

EMBEDDING_AND_OUTPUT = ("embed.tokens", "output")
"""Leaves that get ``optim.decoupled_lr`` (Megatron's ``is_embedding_or_output_parameter``)."""
EMBEDDINGS = ("embed.*", "output")
"""Leaves exempt from weight decay when ``optim.embedding_weight_decay`` is False."""


def schedule_settings(cfg: TrainConfig) -> dict[str, object]:
    """The settings that decide the run's learning rates and weight decay, resolved (decay length
    and warmup in iterations, or in samples for a sample-based run), keyed by their ``optim``
    field names: Megatron's ``OptimizerParamScheduler`` state, which a resume compares."""
    optim = cfg.optim
    unit, warmup, decay, wsd = schedule_lengths(cfg.run, optim)
    return {
        "lr": optim.lr, "min_lr": optim.min_lr, "lr_warmup_init": optim.lr_warmup_init,
        f"lr_warmup_{unit}": warmup, f"lr_decay_{unit}": decay, "lr_decay_style": optim.lr_decay_style,
        f"lr_wsd_decay_{unit}": wsd, "lr_wsd_decay_style": optim.lr_wsd_decay_style,
        "decoupled_lr": optim.decoupled_lr, "decoupled_min_lr": optim.decoupled_min_lr,
        "weight_decay": optim.weight_decay,
    }


def build_lr_schedule(
    cfg: TrainConfig, plan: BatchPlan, train_iters: int, max_lr: Optional[float] = None, min_lr: Optional[float] = None,
    device: str | torch.device = "cpu",
) -> Schedule:
    """``lr(step)`` for the run: warmup, then ``optim.lr_decay_style`` down to the minimum
    (``schedule_settings``); sample-based runs look the step up in a table on ``device`` (the step
    counter's).

    ``max_lr``/``min_lr`` replace ``optim.lr``/``optim.min_lr`` (for a decoupled group); warmup
    still starts from ``optim.lr_warmup_init``.
    """
    run, settings = cfg.run, schedule_settings(cfg)
    unit = schedule_lengths(run, cfg.optim).unit
    schedule = warmup_decay_schedule(
        settings["lr"] if max_lr is None else max_lr, settings["min_lr"] if min_lr is None else min_lr,
        settings[f"lr_warmup_{unit}"], settings[f"lr_decay_{unit}"], settings["lr_decay_style"],
        settings["lr_warmup_init"], settings[f"lr_wsd_decay_{unit}"] or 0, settings["lr_wsd_decay_style"],
    )
    if run.train_iters is not None:
        return schedule
    samples_before = torch.tensor(plan.samples_before_steps(train_iters), dtype=torch.int64, device=device)
    last = len(samples_before) - 1

    def schedule_over_samples(step: torch.Tensor) -> torch.Tensor:
        index = torch.clamp(torch.as_tensor(step, device=samples_before.device), 0, last)
        return schedule(torch.take(samples_before, index))  # a tensor lookup: no host sync on a GPU

    return schedule_over_samples


def decays(cfg: TrainConfig, name: str, leaf: torch.Tensor) -> bool:
    """Whether weight decay applies to the leaf ``name``: matrices only (a ``scan_layers`` block
    leaf's leading layer axis does not count), and not the embeddings and output layer when
    ``optim.embedding_weight_decay`` is False."""
    layer_axis = 1 if cfg.model.scan_layers and name.startswith("layers.") else 0
    return leaf.dim() - layer_axis >= 2 and (cfg.optim.embedding_weight_decay or not name_matches(name, EMBEDDINGS))


def lr_group(cfg: TrainConfig, name: str) -> str:
    """The learning-rate group of the leaf ``name``: ``"<schedule> x<multiplier>"``."""
    optim = cfg.optim
    schedule = "decoupled" if optim.decoupled_lr is not None and name_matches(name, EMBEDDING_AND_OUTPUT) else "main"
    mult = optim.lr_mult if name_matches(name, optim.scale_lr_patterns) else 1.0
    return f"{schedule} x{mult:g}"


def _scaled(schedule: Schedule, mult: float) -> Schedule:
    return schedule if mult == 1.0 else (lambda count: schedule(count) * mult)


def build_optimizer(
    cfg: TrainConfig, lr_schedule: Schedule, params: PyTree, decoupled_schedule: Optional[Schedule] = None
) -> GradientTransformation:
    """AdamW with ``optim``'s betas and epsilon, decoupled weight decay on the leaves ``decays``
    picks, and one lr schedule per ``lr_group`` of ``params`` (the main one, or
    ``decoupled_schedule``, times the group's multiplier)."""
    optim = cfg.optim
    decay_mask = param_labels(params, lambda name, leaf: decays(cfg, name, leaf))
    labels = param_labels(params, lambda name, leaf: lr_group(cfg, name))
    groups = {}
    for label in sorted(set(tree_leaves(labels))):
        schedule_name, mult = label.split(" x")
        schedule = decoupled_schedule if schedule_name == "decoupled" else lr_schedule
        if schedule is None:
            raise ValueError("optim.decoupled_lr is set: build_optimizer needs decoupled_schedule")
        groups[label] = scale_by_learning_rate(_scaled(schedule, float(mult)))
    return chain(
        scale_by_adam(optim.adam_beta1, optim.adam_beta2, optim.adam_eps),
        add_decayed_weights(optim.weight_decay, decay_mask),
        multi_transform(groups, labels),
    )



def run_optimizer(cfg: TrainConfig, plan: BatchPlan, train_iters: int, params: PyTree,
                  device: str | torch.device = "cpu") -> tuple[GradientTransformation, Schedule]:
    """The run's optimizer over ``params`` and its main lr schedule (``build_lr_schedule``; with
    ``optim.decoupled_lr`` a second schedule for the embedding and output layer)."""
    optim = cfg.optim
    schedule = build_lr_schedule(cfg, plan, train_iters, device=device)
    decoupled = (build_lr_schedule(cfg, plan, train_iters, optim.decoupled_lr, optim.decoupled_min_lr, device)
                 if optim.decoupled_lr is not None else None)
    return build_optimizer(cfg, schedule, params, decoupled), schedule
