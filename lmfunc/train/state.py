"""``TrainState``: everything a training step reads and writes, as one pytree."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from lmfunc.compiler.torch_compat.tensors import register_dataclass
from lmfunc.optim import GradientTransformation
from lmfunc.precision import LossScaleConfig, init_loss_scale
from lmfunc.tree import PyTree, tree_device


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer state and counters. A registered pytree: its leaves are tensors.

    step: completed optimizer steps (int64 scalar).
    consumed_samples: sequences trained on so far (int64 scalar), for resumable data order.
    rng: base seed of the step's randomness (dropout), int64 scalar.
    loss_scale: the loss scaler's ``LossScale`` (None without loss scaling).
    """

    params: PyTree
    opt_state: Any
    step: torch.Tensor
    consumed_samples: torch.Tensor
    rng: torch.Tensor
    loss_scale: Optional[Any] = None

    @classmethod
    def create(
        cls, params: PyTree, tx: GradientTransformation, seed: int = 0, loss_scale: Optional[LossScaleConfig] = None
    ) -> "TrainState":
        """A fresh state at step 0 with ``tx.init(params)`` as the optimizer state (and the
        initial loss-scaler state when ``loss_scale`` is given); counters on the params' device."""
        device = tree_device(params)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return cls(
            params=params,
            opt_state=tx.init(params),
            step=zero.clone(),
            consumed_samples=zero.clone(),
            rng=torch.tensor(seed, dtype=torch.int64, device=device),
            loss_scale=init_loss_scale(loss_scale, device) if loss_scale is not None else None,
        )

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)


register_dataclass(TrainState)
