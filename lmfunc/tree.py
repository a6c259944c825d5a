"""Pytree helpers over torch's pytrees (``torch_compat.tensors.pytree``).

Parameters, optimizer state and train state are pytrees: nested ``dict``/``list``/``tuple``/
``NamedTuple`` containers (and registered dataclasses) whose leaves are tensors. Dict keys are
stable strings, so a leaf's dotted path (``"layers.3.attn.wq"``) names it for checkpoints,
sharding rules and parameter groups.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lmfunc.compiler.torch_compat.tensors import pytree

PyTree = Any


class Axes(tuple):
    """Logical axis names of one tensor leaf, e.g. ``Axes(("embed", "mlp"))``.

    A ``tuple`` subclass that pytree functions treat as a *leaf* (as JAX treats
    ``PartitionSpec``), so a tree of axes maps leaf-for-leaf onto the parameter tree.
    """

    def __repr__(self) -> str:
        return f"Axes{tuple.__repr__(self)}"

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten


def tree_map(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """Apply ``fn`` leaf-wise to ``tree`` (and to the matching leaves, or subtrees, of ``rest``)."""
    return pytree.tree_map(fn, tree, *rest, is_leaf=is_leaf)


# Inside a compiled step Dynamo traces every bytecode instruction of a tree walk, except
# ``pytree.tree_map``: that one it maps over its own view of the containers (its "tree_map fast
# path"). Walking with ``pytree.tree_flatten``/``tree_unflatten`` would make most of a step's trace
# pytree code, so while compiling, ``tree_leaves`` and ``tree_unflatten_as`` are built on
# ``pytree.tree_map``: a few dozen instructions per call. The results are pytree's in both modes.


def tree_leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree`` in pytree order (dicts in insertion order; None is a leaf)."""
    if not torch.compiler.is_compiling():
        return pytree.tree_leaves(tree, is_leaf=is_leaf)
    leaves: list[Any] = []
    pytree.tree_map(leaves.append, tree, is_leaf=is_leaf)
    return leaves


_END = object()
_MISSING = object()


def tree_unflatten_as(template: PyTree, leaves: list[Any]) -> PyTree:
    """A tree of ``template``'s structure holding ``leaves`` (in ``tree_leaves`` order):
    ``tree_unflatten(leaves, tree_structure(template))``.

    Under ``torch.compile`` (torch 2.13) with *only Python constants* as leaves, Dynamo folds the
    rebuild and returns an ``OrderedDict`` nested under two NamedTuples as a ``dict``; pytree's own
    ``tree_unflatten`` does the same there. Tensor leaves are unaffected (``tests/test_tree.py``)."""
    if not torch.compiler.is_compiling():
        spec = pytree.tree_structure(template)
        if len(leaves) != spec.num_leaves:
            raise _leaf_count_error(template, leaves)
        return pytree.tree_unflatten(leaves, spec)
    remaining = iter([*leaves, _END])
    tree = pytree.tree_map(lambda _: next(remaining, _MISSING), template)
    if next(remaining, _MISSING) is not _END:
        raise _leaf_count_error(template, leaves)
    return tree


def _leaf_count_error(template: PyTree, leaves: list[Any]) -> ValueError:
    count = len(pytree.tree_leaves(template))
    return ValueError(f"tree_unflatten_as: got {len(leaves)} leaves for a tree of {count} leaves")


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_str(key_path: tuple[Any, ...]) -> str:
    """Dotted name of a pytree key path: ``("layers", "3", "attn", "wq")`` -> ``"layers.3.attn.wq"``."""
    return ".".join(_key_name(entry) for entry in key_path)


def flatten_with_paths(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """``[(dotted_path, leaf), ...]`` in the tree's canonical flattening order."""
    flat, _ = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(path), leaf) for path, leaf in flat]


def tree_map_with_path(
    fn: Callable[[str, Any], Any], tree: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """Apply ``fn(dotted_path, leaf)`` to every leaf, keeping the structure."""
    flat, spec = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return pytree.tree_unflatten([fn(path_str(path), leaf) for path, leaf in flat], spec)


def tree_device(tree: PyTree) -> torch.device:
    """The device of the first tensor leaf of ``tree`` (a DTensor's local device); cpu without tensors.
    Counters and scalars made next to a tree (optimizer counts, the loss scaler) go there."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def tree_size(tree: PyTree) -> int:
    """Total number of elements over all tensor leaves."""
    return sum(leaf.numel() for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor))


def tree_bytes(tree: PyTree) -> int:
    """Total bytes over all tensor leaves (element count times element size)."""
    return sum(
        leaf.numel() * leaf.element_size()
        for leaf in pytree.tree_leaves(tree)
        if isinstance(leaf, torch.Tensor)
    )


def local_tree_bytes(tree: PyTree) -> int:
    """Bytes of this process's part of ``tree``'s tensor leaves (a DTensor counts its local shard)."""
    total = 0
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
            total += local.numel() * local.element_size()
    return total


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of zeros shaped like ``tree`` (optionally in ``dtype``)."""
    return tree_map(lambda leaf: torch.zeros_like(leaf, dtype=dtype), tree)


def tree_allclose(a: PyTree, b: PyTree, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """True when both trees have the same structure and every pair of leaves is close."""
    flat_a, spec_a = pytree.tree_flatten(a)
    flat_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(flat_a, flat_b))


def tree_max_abs_diff(a: PyTree, b: PyTree) -> float:
    """Largest absolute elementwise difference over matching leaves (structures must match)."""
    flat_a, spec_a = pytree.tree_flatten(a)
    flat_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        raise ValueError(f"tree structures differ:\n{spec_a}\nvs\n{spec_b}")
    return max((float((x - y).abs().max()) for x, y in zip(flat_a, flat_b)), default=0.0)
