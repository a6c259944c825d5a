"""The training step as one function: ``step(state, batch) -> (state, metrics)``.

Inside: a loop over microbatches (each differentiates its share of the globally normalised
loss, so gradients just add up), global-norm clipping, the optimizer update and the counters.
With ``compile=True`` the whole step is one ``torch.compile(fullgraph=True)`` graph.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch

from lmfunc.config import ModelConfig
from lmfunc.grad import value_and_grad
from lmfunc.loss import lm_loss
from lmfunc.optim import GradientTransformation, apply_updates, clip_by_global_norm_with_norm, global_norm
from lmfunc.optim.transforms import Schedule
from lmfunc.train.state import TrainState
from lmfunc.tree import tree_flatten, tree_unflatten

Batch = Mapping[str, torch.Tensor]
Metrics = dict[str, torch.Tensor]
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "doc_ids")


def check_batch(batch: Batch) -> None:
    """Raise a clear error unless ``batch`` holds ``[microbatches, B, S]`` tensors with known keys."""
    for key in ("tokens", "labels"):
        if key not in batch:
            raise KeyError(f"batch is missing {key!r}; a batch needs tokens and labels of shape [microbatches, B, S]")
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise KeyError(f"batch has unknown keys {unknown}; expected a subset of {list(BATCH_KEYS)}")
    shape = tuple(batch["tokens"].shape)
    if len(shape) != 3:
        raise ValueError(f"batch['tokens'] must be [microbatches, B, S], got shape {shape}")
    for key, value in batch.items():
        if tuple(value.shape) != shape:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)} but batch['tokens'] has {shape}")


def _microbatch_seed(state: TrainState, index: int) -> torch.Tensor:
    return state.rng * 1_000_003 + state.step * 4096 + index


def _compile(fn: Callable, compile: bool, backend: Union[str, Callable]) -> Callable:
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend) if compile else fn


def make_eval_step(
    cfg: ModelConfig, loss_fn: LossFn = lm_loss, compile: bool = True, backend: Union[str, Callable] = "inductor"
) -> Callable[..., Metrics]:
    """``eval_step(params, batch) -> {"loss_sum", "num_tokens"}`` over all microbatches, no dropout."""

    def eval_step(params, batch: Batch) -> Metrics:
        loss_sum = torch.zeros((), dtype=torch.float32)
        num_tokens = torch.zeros((), dtype=torch.float32)
        for i in range(batch["tokens"].shape[0]):
            micro_loss, micro_tokens = loss_fn(params, {k: v[i] for k, v in batch.items()}, cfg)
            loss_sum, num_tokens = loss_sum + micro_loss, num_tokens + micro_tokens
        return {"loss_sum": loss_sum, "num_tokens": num_tokens}

    return _compile(eval_step, compile, backend)


def make_train_step(
    cfg: ModelConfig,
    tx: GradientTransformation,
    *,
    clip_grad: float = 1.0,
    lr_schedule: Optional[Schedule] = None,
    loss_fn: LossFn = lm_loss,
    compile: bool = True,
    backend: Union[str, Callable] = "inductor",
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build ``step(state, batch) -> (state, metrics)``.

    batch: ``tokens``/``labels`` (and optional ``loss_mask``, ``position_ids``, ``doc_ids``) of
        shape ``[M, B, S]`` with M microbatches. The loss is ``sum(loss * mask) / sum(mask)``
        over the whole batch, whatever M is.
    clip_grad: global-norm clip (Megatron's rule); 0 disables clipping.
    lr_schedule: reported as ``metrics["lr"]`` (the lr this update used) when given.
    loss_fn: ``loss_fn(params, microbatch, cfg, dropout_seed) -> (loss_sum, num_tokens)``.
    compile/backend: compile the whole step with ``torch.compile(fullgraph=True)`` and this backend.
    Metrics: ``loss`` (mean over tokens), ``grad_norm`` (before clipping), ``num_tokens``, ``lr``.
    """
    dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0

    def share_of_loss(params, micro: Batch, total_tokens: torch.Tensor, seed):
        loss_sum, _ = loss_fn(params, micro, cfg, seed)
        return loss_sum / total_tokens, loss_sum

    grad_fn = value_and_grad(share_of_loss, has_aux=True)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        check_batch(batch)
        num_micro, micro_batch = batch["tokens"].shape[:2]
        if "loss_mask" in batch:
            num_tokens = batch["loss_mask"].to(torch.float32).sum()
        else:
            num_tokens = torch.tensor(float(batch["tokens"].numel()))
        denominator = torch.clamp(num_tokens, min=1.0)
        loss_sum = torch.zeros((), dtype=torch.float32)
        grad_leaves, spec = None, None
        for i in range(num_micro):
            micro = {k: v[i] for k, v in batch.items()}
            seed = _microbatch_seed(state, i) if dropout else None
            (_, micro_loss), grads = grad_fn(state.params, micro, denominator, seed)
            leaves, spec = tree_flatten(grads)
            grad_leaves = leaves if grad_leaves is None else torch._foreach_add(grad_leaves, leaves)
            loss_sum = loss_sum + micro_loss
        grads = tree_unflatten(grad_leaves, spec)
        if clip_grad > 0:
            grads, grad_norm = clip_by_global_norm_with_norm(grads, clip_grad)
        else:
            grad_norm = global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            params=apply_updates(state.params, updates),
            opt_state=opt_state,
            step=state.step + 1,
            consumed_samples=state.consumed_samples + num_micro * micro_batch,
        )
        metrics = {"loss": loss_sum / denominator, "grad_norm": grad_norm, "num_tokens": num_tokens}
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step)
        return new_state, metrics

    return _compile(train_step, compile, backend)
