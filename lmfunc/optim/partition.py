"""Parameter groups as data, optax style: ``masked`` and ``multi_transform`` over the param tree.

Megatron builds optimizer parameter groups (no weight decay on norms and biases, a decoupled lr
for the embedding and output layer, lr multipliers chosen by name). Here a group is a label per
leaf — a tree of labels shaped like the params, or a function of the params that returns one —
and each label gets its own ``GradientTransformation``. ``param_labels`` builds such a tree from
dotted leaf names.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Optional, Sequence, Union

from lmfunc.optim.transforms import GradientTransformation, _resolve_mask
from lmfunc.tree import PyTree, tree_leaves, tree_map_with_path, tree_unflatten_as

Labels = Union[PyTree, Callable[[PyTree], PyTree]]


class MaskedState(NamedTuple):
    inner_state: Any


class MultiTransformState(NamedTuple):
    inner_states: dict


def _select(leaves: Optional[list], indices: list[int]) -> Optional[list]:
    return None if leaves is None else [leaves[i] for i in indices]


def masked(inner: GradientTransformation, mask: Union[PyTree, Callable[[PyTree], PyTree]]) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; the other updates pass through unchanged.

    ``inner`` sees (and keeps state for) the selected leaves only, as a flat list.
    """

    def init(params: PyTree) -> MaskedState:
        chosen = [i for i, f in enumerate(_resolve_mask(mask, params)) if f]
        return MaskedState(inner.init(_select(tree_leaves(params), chosen)))

    def update(updates: PyTree, state: MaskedState, params: Optional[PyTree] = None):
        leaves = tree_leaves(updates)
        reference = params if params is not None else updates
        chosen = [i for i, f in enumerate(_resolve_mask(mask, reference)) if f]
        param_leaves = tree_leaves(params) if params is not None else None
        new, inner_state = inner.update(_select(leaves, chosen), state.inner_state, _select(param_leaves, chosen))
        for i, value in zip(chosen, new):
            leaves[i] = value
        return tree_unflatten_as(updates, leaves), MaskedState(inner_state)

    return GradientTransformation(init, update)


def _resolve_labels(labels: Labels, params: PyTree, transforms: Mapping[Hashable, GradientTransformation]) -> list:
    tree = labels(params) if callable(labels) else labels
    flat = tree_leaves(tree)
    if len(flat) != len(tree_leaves(params)):
        raise ValueError(f"labels have {len(flat)} leaves but params have {len(tree_leaves(params))}; "
                         "give one label per parameter leaf")
    unknown = sorted({str(label) for label in flat if label not in transforms})
    if unknown:
        raise ValueError(f"labels {unknown} have no transformation; known labels: {sorted(map(str, transforms))}")
    return flat


def multi_transform(transforms: Mapping[Hashable, GradientTransformation], labels: Labels) -> GradientTransformation:
    """Apply ``transforms[label]`` to the leaves labelled ``label`` (each label's state is separate).

    ``labels``: a tree of labels shaped like the params, or ``labels(params) -> tree``.
    """

    def groups(params: PyTree) -> dict[Hashable, list[int]]:
        out: dict[Hashable, list[int]] = {label: [] for label in transforms}
        for i, label in enumerate(_resolve_labels(labels, params, transforms)):
            out[label].append(i)
        return out

    def init(params: PyTree) -> MultiTransformState:
        leaves = tree_leaves(params)
        return MultiTransformState({label: transforms[label].init(_select(leaves, idx))
                                    for label, idx in groups(params).items()})

    def update(updates: PyTree, state: MultiTransformState, params: Optional[PyTree] = None):
        leaves = tree_leaves(updates)
        param_leaves = tree_leaves(params) if params is not None else None
        new_states = {}
        for label, idx in groups(params if params is not None else updates).items():
            new, new_states[label] = transforms[label].update(
                _select(leaves, idx), state.inner_states[label], _select(param_leaves, idx)
            )
            for i, value in zip(idx, new):
                leaves[i] = value
        return tree_unflatten_as(updates, leaves), MultiTransformState(new_states)

    return GradientTransformation(init, update)


def name_matches(name: str, patterns: Sequence[str]) -> bool:
    """``name`` matches one of the shell-style ``patterns`` (``*`` spans dots: ``*.attn.w?``)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def param_labels(params: PyTree, label_of: Callable[[str, Any], Hashable]) -> PyTree:
    """A tree shaped like ``params`` holding ``label_of(dotted_name, leaf)`` at each leaf."""
    return tree_map_with_path(label_of, params)
