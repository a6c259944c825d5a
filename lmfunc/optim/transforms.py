"""optax-style gradient transformations over parameter pytrees.

A ``GradientTransformation`` is a pair of pure functions: ``init(params) -> state`` and
``update(updates, state, params) -> (updates, state)``. Transformations compose with
``chain``; ``adamw`` is ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``.
States are NamedTuples of tensors (pytrees), so they checkpoint and compile like params.
Leaf-wise arithmetic uses torch's foreach ops (``torch_compat.tensors``) over the flattened leaves (one fused kernel
group per op, and faster to compile than a per-leaf Python loop).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from lmfunc.compiler.torch_compat.tensors import foreach_add, foreach_div, foreach_mul, foreach_norm, foreach_sqrt, foreach_sub
from lmfunc.tree import PyTree, tree_device, tree_leaves, tree_map, tree_unflatten_as

Schedule = Callable[[torch.Tensor], torch.Tensor]
Mask = Union[PyTree, Callable[[PyTree], PyTree]]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params) -> (new_updates, new_state)``."""

    init: Callable[[PyTree], Any]
    update: Callable[[PyTree, Any, Optional[PyTree]], tuple[PyTree, Any]]


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor
    mu: PyTree
    nu: PyTree


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor


def _count(params: PyTree) -> torch.Tensor:
    """An update counter on the device of ``params``."""
    return torch.zeros((), dtype=torch.int64, device=tree_device(params))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states."""

    def init(params: PyTree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple, params: Optional[PyTree] = None) -> tuple[PyTree, tuple]:
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam direction ``m_hat / (sqrt(v_hat) + eps)`` with fp32 moments and bias correction.

    The moments are updated as ``m + (1 - b) * (x - m)`` (``torch.optim.AdamW``'s ``lerp_`` for the
    first moment; the same average as ``b * m + (1 - b) * x``). The last op takes the old moment as
    its first argument, so in a step that writes its new state into the old one
    (``make_train_step(donate_state=True)``) Inductor turns it into one in-place update of the
    moment. In the form ``b * m + ...`` the write comes last in the graph, and every later reader
    inlines the whole moment expression instead (``tests/test_step.py`` counts Inductor's nodes).
    """

    def init(params: PyTree) -> ScaleByAdamState:
        zeros = lambda p: torch.zeros_like(p, dtype=torch.float32)  # noqa: E731
        return ScaleByAdamState(_count(params), tree_map(zeros, params), tree_map(zeros, params))

    def update(updates: PyTree, state: ScaleByAdamState, params: Optional[PyTree] = None):
        grads = tree_leaves(updates)
        mu, nu = tree_leaves(state.mu), tree_leaves(state.nu)
        mu = foreach_add(mu, foreach_sub(grads, mu), alpha=1.0 - b1)
        nu = foreach_add(nu, foreach_sub(foreach_mul(grads, grads), nu), alpha=1.0 - b2)
        count = state.count + 1
        step = count.to(torch.float32)
        bias1 = 1.0 - torch.pow(b1, step)
        bias2 = 1.0 - torch.pow(b2, step)
        denom = foreach_add(foreach_sqrt(foreach_div(nu, bias2)), eps)
        direction = foreach_div(foreach_div(mu, bias1), denom)
        new_state = ScaleByAdamState(count, tree_unflatten_as(state.mu, mu), tree_unflatten_as(state.nu, nu))
        return tree_unflatten_as(updates, direction), new_state

    return GradientTransformation(init, update)


def decay_mask(params: PyTree) -> PyTree:
    """Default weight-decay mask: True for leaves with 2+ dims, False for norms and biases (1-D).
    A ``scan_layers`` model's stacked norms are 2-D; the trainer's rule
    (``lmfunc.train.make_optimizer.decays``) knows its layer axis."""
    return tree_map(lambda p: p.dim() >= 2, params)


def _resolve_mask(mask: Mask, params: PyTree) -> list[bool]:
    tree = mask(params) if callable(mask) else mask
    flags = tree_leaves(tree)
    if len(flags) != len(tree_leaves(params)):
        raise ValueError(
            f"mask has {len(flags)} leaves but params have {len(tree_leaves(params))}; "
            "the mask must be a tree of bools shaped like the params"
        )
    return [bool(f) for f in flags]


def add_decayed_weights(weight_decay: float, mask: Optional[Mask] = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on the leaves where ``mask`` is True (all if None)."""

    def update(updates: PyTree, state: EmptyState, params: Optional[PyTree] = None):
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        if weight_decay == 0.0:
            return updates, state
        leaves = tree_leaves(updates)
        param_leaves = tree_leaves(params)
        flags = _resolve_mask(mask, params) if mask is not None else [True] * len(leaves)
        chosen = [i for i, f in enumerate(flags) if f]
        decayed = foreach_add([leaves[i] for i in chosen], [param_leaves[i] for i in chosen], alpha=weight_decay)
        for i, value in zip(chosen, decayed):
            leaves[i] = value
        return tree_unflatten_as(updates, leaves), state

    return GradientTransformation(lambda params: EmptyState(), update)


def global_norm(tree: PyTree) -> torch.Tensor:
    """L2 norm over all leaves of ``tree`` (fp32 scalar)."""
    norms = foreach_norm([leaf.float() for leaf in tree_leaves(tree)])
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_by_global_norm_with_norm(tree: PyTree, max_norm: float,
                                  norm: Optional[torch.Tensor] = None) -> tuple[PyTree, torch.Tensor]:
    """Megatron's clip: scale by ``max_norm / (norm + 1e-6)`` only when that is < 1.

    ``norm``: the global norm when ``tree`` is only part of the gradients (a pipeline stage's);
    default ``global_norm(tree)``. Returns ``(clipped_tree, pre_clip_norm)``; branch-free, so it
    compiles to one graph.
    """
    norm = global_norm(tree) if norm is None else norm
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tree_unflatten_as(tree, foreach_mul(tree_leaves(tree), coeff)), norm


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Rescale updates so their global L2 norm is at most ``max_norm``."""

    def update(updates: PyTree, state: EmptyState, params: Optional[PyTree] = None):
        clipped, _ = clip_by_global_norm_with_norm(updates, max_norm)
        return clipped, state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """Multiply updates by ``schedule(count)``, where count is the number of updates so far."""

    def init(params: PyTree) -> ScaleByScheduleState:
        return ScaleByScheduleState(_count(params))

    def update(updates: PyTree, state: ScaleByScheduleState, params: Optional[PyTree] = None):
        factor = schedule(state.count).to(torch.float32)
        scaled = tree_unflatten_as(updates, foreach_mul(tree_leaves(updates), factor))
        return scaled, ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``."""
    return lambda count: torch.full((), value, dtype=torch.float32, device=count.device)


def scale_by_learning_rate(learning_rate: Union[float, Schedule]) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (a float or a schedule of the update count)."""
    schedule = learning_rate if callable(learning_rate) else constant_schedule(float(learning_rate))
    return scale_by_schedule(lambda count: -schedule(count))


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf-wise, keeping each param's dtype."""
    leaves = tree_leaves(params)
    deltas = [u.to(p.dtype) for p, u in zip(leaves, tree_leaves(updates))]
    return tree_unflatten_as(params, foreach_add(leaves, deltas))


def adamw(
    learning_rate: Union[float, Schedule],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Optional[Mask] = decay_mask,
) -> GradientTransformation:
    """AdamW (decoupled weight decay), equal to ``torch.optim.AdamW``:
    ``p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``; defaults are Megatron's."""
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
