"""Continuing a Megatron-LM run: the position its checkpoint records, applied to lmfunc's state.

``--checkpoint.load-megatron`` brings the weights over (``lmfunc.checkpoint.megatron``). When the
save is a training save (``iter_NNNNNNN/`` holding Megatron's ``iteration`` and its ``args``), the
run also continues where Megatron stopped: the step counter at Megatron's iteration, the data at its
``consumed_train_samples``, and the lr schedule at that iteration, so the first lmfunc update uses
the learning rate Megatron's ``OptimizerParamScheduler`` would give its next one. For that, the
schedule and batch settings must be Megatron's (else ``ConfigError`` lists the flags). The Adam
moments and step count continue too where the save holds them in a format lmfunc reads
(``lmfunc.checkpoint.megatron_optimizer`` names which), with a mixed-precision run's fp32 master
weights; otherwise they start fresh, as with Megatron's ``--no-load-optim``. An fp16 run's dynamic
loss scaler continues from Megatron's (its scale and both trackers) when this run scales the loss
dynamically too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch

from lmfunc.config.model import ConfigError
from lmfunc.config.sections import schedule_lengths
from lmfunc.config.train import TrainConfig
from lmfunc.optim.transforms import ScaleByAdamState, ScaleByScheduleState
from lmfunc.train.state import TrainState
from lmfunc.tree import PyTree, flatten_with_paths, tree_map, tree_unflatten_as


class MegatronPosition(NamedTuple):
    iteration: int
    consumed_samples: int


def megatron_position(cfg: TrainConfig) -> Optional[MegatronPosition]:
    """Where the Megatron run of ``checkpoint.load_megatron`` stopped, or None when the save records
    no training position (a ``release`` save, one of megatron-core alone) or ``checkpoint.finetune``
    asks for the weights alone. Raises ``ConfigError``
    when lmfunc's schedule or batch settings differ from the run's (naming the flags to pass) or
    the run was sample-based."""
    from lmfunc.checkpoint.megatron import megatron_run_state
    from lmfunc.checkpoint.megatron_args import schedule_mismatches

    path = cfg.checkpoint.load_megatron
    if path is None or cfg.checkpoint.finetune:  # finetune: the weights alone, from step 0 (Megatron's --finetune)
        return None
    iteration, args, source = megatron_run_state(path)
    if iteration is None or args is None or not iteration:
        return None
    if getattr(args, "train_samples", None) is not None:
        raise ConfigError(f"{source}: the Megatron run was sample-based (--train-samples); lmfunc continues "
                          "iteration-based runs only. Pass --checkpoint.load-megatron with a release save to take the "
                          "weights alone")
    if cfg.run.train_iters is None:
        raise ConfigError(f"{source}: continuing Megatron's iteration-based run needs run.train_iters (Megatron's "
                          f"--train-iters was {getattr(args, 'train_iters', None)})")
    lengths = schedule_lengths(cfg.run, cfg.optim)
    ours = {"lr": cfg.optim.lr, "min_lr": cfg.optim.min_lr, "lr_decay_style": cfg.optim.lr_decay_style,
            "lr_warmup_init": cfg.optim.lr_warmup_init, "lr_warmup_iters": lengths.warmup,
            "lr_decay_iters": lengths.decay, "global_batch_size": cfg.run.global_batch_size,
            "calculate_per_token_loss": cfg.run.calculate_per_token_loss}
    scaling = cfg.precision.loss_scaling()
    if scaling is not None and scaling.dynamic:
        ours |= {"loss_scale_window": scaling.growth_interval, "hysteresis": scaling.hysteresis,
                 "min_loss_scale": scaling.min_scale}
    differing = schedule_mismatches(args, ours)
    if differing:
        raise ConfigError(
            f"{source}: the Megatron run stopped at iteration {iteration} with another lr schedule, batch or loss scaler than this "
            "run's: " + "; ".join(f"{name} is {theirs} there, {mine} here" for name, (theirs, mine, _) in differing.items())
            + ". To continue it, pass " + " ".join(flag for _, _, flag in differing.values()))
    consumed = getattr(args, "consumed_train_samples", None)
    return MegatronPosition(iteration, int(consumed if consumed is not None else iteration * cfg.run.global_batch_size))


def continued_state(state: TrainState, position: MegatronPosition) -> TrainState:
    """``state`` (freshly created) at Megatron's position: step and consumed samples, and every lr
    schedule's update count at the iteration (Adam's own count is its moments', ``with_megatron_adam``)."""
    def at_iteration(node):
        if isinstance(node, ScaleByScheduleState):
            return ScaleByScheduleState(torch.full_like(node.count, position.iteration))
        return node

    opt_state = tree_map(at_iteration, state.opt_state, is_leaf=lambda node: isinstance(node, ScaleByScheduleState))
    return dataclasses.replace(state, opt_state=opt_state,
                               step=torch.full_like(state.step, position.iteration),
                               consumed_samples=torch.full_like(state.consumed_samples, position.consumed_samples))


def placed_like(full: PyTree, like: PyTree) -> PyTree:
    """The leaves of the full tree ``full`` at the paths of ``like`` (a run's params or moments: the
    whole tree, or a pipeline rank's part), each placed as ``like``'s leaf is (its DTensor mesh and
    placements, or its device)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    leaves = dict(flatten_with_paths(full))

    def place(path: str, leaf: torch.Tensor) -> torch.Tensor:
        value = leaves[path].to(leaf.dtype)
        if isinstance(leaf, DTensor):
            return distribute_tensor(value, leaf.device_mesh, leaf.placements)
        return value.to(leaf.device)

    return tree_unflatten_as(like, [place(path, leaf) for path, leaf in flatten_with_paths(like)])


def with_megatron_adam(state: TrainState, adam) -> TrainState:
    """``state`` with the Adam moments and count of ``adam`` (a read ``MegatronAdam``), and its fp32
    master weights as the params when the save holds them."""
    def adam_state(node):
        if isinstance(node, ScaleByAdamState):
            return ScaleByAdamState(torch.full_like(node.count, adam.count), placed_like(adam.mu, node.mu),
                                    placed_like(adam.nu, node.nu))
        return node

    opt_state = tree_map(adam_state, state.opt_state, is_leaf=lambda node: isinstance(node, ScaleByAdamState))
    params = placed_like(adam.master_weights, state.params) if adam.master_weights is not None else state.params
    return dataclasses.replace(state, params=params, opt_state=opt_state)


def with_megatron_loss_scale(state: TrainState, scaler) -> TrainState:
    """``state`` with the scale and trackers of ``scaler`` (a read ``MegatronLossScale``); its
    skipped-step count starts at 0 (Megatron does not save one)."""
    current = state.loss_scale
    loss_scale = dataclasses.replace(
        current, scale=torch.full_like(current.scale, scaler.scale),
        growth_tracker=torch.full_like(current.growth_tracker, scaler.growth_tracker),
        hysteresis_tracker=torch.full_like(current.hysteresis_tracker, scaler.hysteresis_tracker))
    return dataclasses.replace(state, loss_scale=loss_scale)


def _continued_loss_scale(cfg: TrainConfig, state: TrainState) -> tuple[TrainState, Optional[str]]:
    """``state`` with the Megatron save's loss scaler when both runs scale dynamically, and what was
    done (None when neither run has a dynamic scaler)."""
    from lmfunc.checkpoint.megatron_optimizer import read_megatron_loss_scale

    scaler = read_megatron_loss_scale(cfg.checkpoint.load_megatron)
    scaling = cfg.precision.loss_scaling()
    dynamic = state.loss_scale is not None and scaling is not None and scaling.dynamic
    if scaler is None:
        return state, "a fresh loss scale" if dynamic else None
    if not dynamic:
        why = ("its precision.loss_scale is static" if scaling is not None
               else f"its precision.compute_dtype is {cfg.precision.compute_dtype}")
        return state, f"Megatron's loss scale {scaler.scale:g} not used: this run has no dynamic loss scaling ({why})"
    state = with_megatron_loss_scale(state, scaler)
    return state, (f"Megatron's loss scale {scaler.scale:g} (growth tracker {scaler.growth_tracker}, "
                   f"hysteresis tracker {scaler.hysteresis_tracker})")


def megatron_start(cfg: TrainConfig, state: TrainState, echo: Callable[[str], None]) -> TrainState:
    """``state`` continued at the position of ``checkpoint.load_megatron`` (said through
    ``echo``), or unchanged when the run starts from no Megatron training save."""
    from lmfunc.checkpoint.megatron_optimizer import load_megatron_adam

    position = megatron_position(cfg)
    if position is None:
        return state
    adam = load_megatron_adam(cfg.checkpoint.load_megatron, cfg.model)
    state = continued_state(state, position)
    if adam.read:
        state = with_megatron_adam(state, adam)
        what = f"Megatron's Adam moments at step {adam.count}" + (", its fp32 master weights" if adam.master_weights else "")
    else:
        what = f"fresh Adam moments: the save holds {adam.format}"
    state, scaling = _continued_loss_scale(cfg, state)
    echo(f"continuing the Megatron run of {cfg.checkpoint.load_megatron} at iteration {position.iteration} "
         f"({position.consumed_samples} samples consumed; {what}" + (f"; {scaling})" if scaling else ")"))
    return state
