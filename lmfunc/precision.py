"""Mixed precision: the compute-dtype policy and Megatron's loss scaling, as pure tensor logic.

Parameters and optimizer state stay fp32 ("master" weights). Each microbatch casts the params to
the compute dtype *inside* the differentiated function, so the cast's backward hands back fp32
gradients: they are accumulated and clipped in fp32. Norms, softmax statistics, logits and the
loss are computed in fp32 by the layers themselves (``layers.upcast``).

Loss scaling (fp16) follows Megatron's ``DynamicGradScaler``: the loss is multiplied by ``scale``
before differentiation, the gradients are divided by it, and a step whose gradients are not all
finite is skipped. ``update_loss_scale`` is branch-free (``torch.where``), so it lives inside the
one compiled train step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Partial

from lmfunc.compiler.torch_compat.tensors import register_dataclass
from lmfunc.tree import PyTree, tree_leaves, tree_map

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    """``"fp32" | "bf16" | "fp16"`` -> the torch dtype; anything else is a clear error."""
    if name not in DTYPES:
        raise ValueError(f"unknown compute dtype {name!r}; choose one of {list(DTYPES)}")
    return DTYPES[name]


def set_tf32(enabled: bool) -> None:
    """Let CUDA's fp32 matmuls and convolutions use TF32 (``precision.tf32``), or keep them IEEE fp32.
    A process-wide torch setting; it changes nothing on the CPU."""
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision


def cast_params(params: PyTree, dtype: torch.dtype) -> PyTree:
    """Floating-point leaves of ``params`` in ``dtype`` (a no-op for fp32); differentiable."""
    return tree_map(lambda p: p.to(dtype) if p.is_floating_point() and p.dtype != dtype else p, params)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Megatron's loss-scaler settings. ``dynamic=False`` keeps ``initial_scale`` forever
    (``ConstantGradScaler``); the defaults are Megatron's fp16 defaults."""

    dynamic: bool = True
    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        problems = []
        if not (self.initial_scale > 0 and math.isfinite(self.initial_scale)):
            problems.append(f"initial_scale must be positive and finite, got {self.initial_scale}")
        if not 0 < self.min_scale <= self.initial_scale:
            problems.append(f"min_scale must be in (0, initial_scale={self.initial_scale}], got {self.min_scale}")
        if self.growth_factor <= 1.0:
            problems.append(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1 or self.hysteresis < 1:
            problems.append(f"growth_interval and hysteresis must be >= 1, got {self.growth_interval}, {self.hysteresis}")
        if problems:
            raise ValueError("loss scaling: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Loss-scaler state, a pytree of scalars: the scale (fp32), Megatron's growth and hysteresis
    trackers, and the number of skipped (non-finite) steps so far (int64)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    skipped_steps: torch.Tensor


register_dataclass(LossScale)


def init_loss_scale(cfg: LossScaleConfig, device: str | torch.device = "cpu") -> LossScale:
    """The scaler state before the first step, on ``device`` (the params' device)."""
    return LossScale(
        scale=torch.tensor(cfg.initial_scale, dtype=torch.float32, device=device),
        growth_tracker=torch.zeros((), dtype=torch.int64, device=device),
        hysteresis_tracker=torch.tensor(cfg.hysteresis, dtype=torch.int64, device=device),
        skipped_steps=torch.zeros((), dtype=torch.int64, device=device),
    )


def update_loss_scale(state: LossScale, found_inf: torch.Tensor, cfg: LossScaleConfig) -> LossScale:
    """Megatron's ``DynamicGradScaler.update(found_inf)``, branch-free.

    Overflow: growth tracker 0, hysteresis tracker - 1, and when that reaches <= 0 the scale backs
    off (never below ``min_scale``). Clean step: growth tracker + 1; at ``growth_interval`` it
    resets, the hysteresis tracker is restored and the scale grows. Clean steps do not restore the
    hysteresis otherwise (as in Megatron). A static scaler only counts skipped steps.
    """
    skipped = state.skipped_steps + found_inf.to(torch.int64)
    if not cfg.dynamic:
        return dataclasses.replace(state, skipped_steps=skipped)
    hysteresis = torch.where(found_inf, state.hysteresis_tracker - 1, state.hysteresis_tracker)
    backoff = found_inf & (hysteresis <= 0)
    growth = torch.where(found_inf, torch.zeros_like(state.growth_tracker), state.growth_tracker + 1)
    grow = growth == cfg.growth_interval
    growth = torch.where(grow, torch.zeros_like(growth), growth)
    hysteresis = torch.where(grow, torch.full_like(hysteresis, cfg.hysteresis), hysteresis)
    scale = torch.where(backoff, torch.clamp(state.scale * cfg.backoff_factor, min=cfg.min_scale), state.scale)
    scale = torch.where(grow, scale * cfg.growth_factor, scale)
    return LossScale(scale, growth, hysteresis, skipped)


def all_finite(tree: PyTree) -> torch.Tensor:
    """A bool scalar, equal on every rank: every element of every leaf is finite (one reduction per
    leaf). DTensor leaves are checked on their local shards, and the flag is reduced over their
    meshes (a maximum of the overflow flag): DTensor's own reductions of mixed placements fail
    (a ``Partial(product)`` flag cannot meet a replicated one)."""
    leaves = tree_leaves(tree)
    local = [leaf.to_local() if isinstance(leaf, DTensor) else leaf for leaf in leaves]
    overflow = (~torch.stack([torch.isfinite(leaf).all() for leaf in local]).all()).to(torch.float32)
    meshes = {leaf.device_mesh for leaf in leaves if isinstance(leaf, DTensor)}
    for mesh in meshes:
        overflow = DTensor.from_local(overflow, mesh, [Partial("max")] * mesh.ndim, run_check=False).full_tensor()
    return overflow == 0


def select_tree(pred: torch.Tensor, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leaf-wise ``where(pred, on_true, on_false)`` for a scalar bool ``pred`` (trees of equal structure)."""
    return tree_map(lambda a, b: torch.where(pred, a, b), on_true, on_false)


def check_for_nan_in_loss(loss: float, step: int, rank: int = 0, skipped: Optional[bool] = None) -> None:
    """Raise ``FloatingPointError`` naming the step and rank when the reported loss is NaN or inf.

    With dynamic loss scaling an overflow in the *scaled* backward pass is handled by skipping the
    step; this check is about the (unscaled) loss itself, as Megatron's
    ``check_for_nan_in_loss_and_grad``.
    """
    if math.isfinite(loss):
        return
    note = " (the step was skipped by the loss scaler)" if skipped else ""
    raise FloatingPointError(
        f"the training loss is {loss} at step {step} on rank {rank}{note}; lower optim.lr, use "
        "precision.compute_dtype bf16/fp32, or check the data; precision.check_for_nan_in_loss false disables this check"
    )
