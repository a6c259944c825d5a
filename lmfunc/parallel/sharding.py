"""Sharding as data: logical axis names -> mesh dims (MaxText's logical axis rules).

Every parameter leaf carries logical axis names (``model.param_axes``: ``("embed", "heads")``,
``("vocab", "embed")`` ...). A rules table maps names to mesh dims, in order; a leaf's placement on
each mesh dim is ``Shard(i)`` for the first of its axes ``i`` whose rule names that dim, else
``Replicate()``. Storage placements shard over the data-parallel dims too (FSDP, which with the
optimizer state sharded alike is also Megatron's distributed optimizer); ``gather`` redistributes a
parameter to its compute placements (data-parallel dims replicated) right where the layer uses it,
and autograd turns that all-gather into a reduce-scatter of the gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from lmfunc.parallel.context import CP_DIM, context_part
from lmfunc.parallel.placement import DATA_PARALLEL_DIMS
from lmfunc.tree import PyTree, flatten_with_paths, tree_map, tree_map_with_path

Rules = Sequence[tuple[str, Sequence[str]]]

EP_RULES: Rules = (("experts", ("ep",)),)
"""Expert parallelism: the routed experts split over ``ep``."""
FSDP_RULES: Rules = (("embed", ("dp_shard", "ep")), ("mtp_concat", ("dp_shard", "ep")),
                     ("q_lora", ("dp_shard", "ep")), ("kv_lora", ("dp_shard", "ep")))
"""Parameters sharded over the data-parallel shard dims along their hidden-size axis: ``dp_shard``
and ``ep`` together (``ep`` is the inner factor of the data-parallel shard ranks), or ``dp_shard``
alone for the experts, whose ``ep`` the ``EP_RULES`` claim first. MLA's up-projections and latent
norms have no hidden-size axis: they are sharded along their latent axis (``q_lora``,
``kv_lora``), so every leaf of a layer is split over the data-parallel ranks, as Megatron's
distributed optimizer splits them (left whole, DeepSeek-V3's ``wq_up`` and ``wkv_up`` with their
gradients and Adam moments are 0.81 GiB a layer on every rank)."""
TP_RULES: Rules = (("heads", ("tp",)), ("kv_heads", ("tp",)), ("mlp", ("tp",)), ("vocab", ("tp",)))
"""Megatron's tensor parallelism: attention heads, MLP width and vocabulary split over ``tp``."""
DEFAULT_RULES: Rules = EP_RULES + TP_RULES + FSDP_RULES
COMPUTE_RULES: Rules = EP_RULES + TP_RULES
"""The compute layout's rules (``lmfunc.parallel.placement.gather``): FSDP gathered, the experts
still split over ``ep``."""


def shard_axes(axes: Sequence[str], mesh_dim_names: Sequence[str], rules: Rules = DEFAULT_RULES) -> list[Optional[int]]:
    """For each mesh dim, the axis of a leaf with logical ``axes`` that it is sharded along (None:
    replicated). The rules, in order: each takes the first axis named by it that no earlier rule
    took, and shards it over every one of its mesh dims not yet used (several dims: nested, the
    outer dim first, as one dim of their product would)."""
    names = tuple(mesh_dim_names)
    sharded: list[Optional[int]] = [None] * len(names)
    used_axes: set[int] = set()
    for logical, mesh_dims in rules:
        free = [names.index(d) for d in mesh_dims if d in names and sharded[names.index(d)] is None]
        axis = next((i for i, name in enumerate(axes) if name == logical and i not in used_axes), None)
        if not free or axis is None:
            continue
        used_axes.add(axis)
        for dim in free:
            sharded[dim] = axis
    return sharded


def placements_for(axes: Sequence[str], mesh: DeviceMesh, rules: Rules = DEFAULT_RULES) -> list[Placement]:
    """Storage placements of a leaf with logical ``axes`` on ``mesh`` (one per mesh dim)."""
    return [Replicate() if i is None else Shard(i) for i in shard_axes(axes, mesh.mesh_dim_names, rules)]


def local_shape(shape: Sequence[int], axes: Sequence[str], sizes: dict[str, int],
                rules: Rules = DEFAULT_RULES) -> tuple[int, ...]:
    """Shape of the largest shard of a leaf of ``shape`` and logical ``axes`` on a mesh of ``sizes``
    (mesh dim name -> size): a sharded axis is split into ceil-sized pieces, as DTensor splits it."""
    local = list(shape)
    names = [name for name, size in sizes.items() if size > 1]
    for name, axis in zip(names, shard_axes(axes, names, rules)):
        if axis is not None:
            local[axis] = -(-local[axis] // sizes[name])
    return tuple(local)


def shard_params(params: PyTree, axes: PyTree, mesh: DeviceMesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Distribute full ``params`` (equal on every rank) onto ``mesh`` by the rules: DTensor leaves.
    ``axes`` is the matching tree of logical axis names (``model.param_axes(cfg)``)."""
    axes_by_path = dict(flatten_with_paths(axes))

    def place(path: str, leaf: torch.Tensor) -> DTensor:
        return distribute_tensor(leaf, mesh, placements_for(axes_by_path[path], mesh, rules))

    return tree_map_with_path(place, params)


def init_sharded(specs: PyTree, make_leaf: Callable[[str, Any], torch.Tensor], mesh: DeviceMesh,
                 rules: Rules = DEFAULT_RULES) -> PyTree:
    """Parameters made directly into shards, one leaf at a time. ``specs`` is a tree of leaf
    specs with an ``axes`` field (``model.gpt.param_specs(cfg)``); ``make_leaf(path, spec)`` makes
    the full leaf (the same on every rank: ``model.gpt.init_leaf`` draws each leaf from its own
    (seed, name) generator). So the result equals ``shard_params`` of the whole tree on any mesh,
    and no rank holds more than one full leaf at once."""

    def make(path: str, spec: Any) -> DTensor:
        return distribute_tensor(make_leaf(path, spec), mesh, placements_for(spec.axes, mesh, rules))

    return tree_map_with_path(make, specs, is_leaf=lambda x: hasattr(x, "axes") and not isinstance(x, dict))


def local_batch_to_dtensor(batch: dict, mesh: DeviceMesh, batch_dim: int = 1) -> dict:
    """This rank's data-parallel slice of a batch (``[M, B_local, S]`` tensors of whole sequences) as
    DTensors of the global batch. On a mesh with a ``cp`` dim each sequence is put in Megatron's
    load-balanced order (``lmfunc.parallel.context``) and split over ``cp``: the rank keeps its two
    chunks of every field."""
    names = list(mesh.mesh_dim_names)
    placements = [Shard(batch_dim) if name in DATA_PARALLEL_DIMS else Replicate() for name in names]
    if CP_DIM in names:
        placements[names.index(CP_DIM)] = Shard(batch_dim + 1)
    return {k: DTensor.from_local(v, mesh, placements, run_check=False) for k, v in context_split(batch, mesh).items()}


def context_split(batch: dict, mesh: Optional[DeviceMesh]) -> dict:
    """This rank's part of every field of ``batch`` (tensors whose last dim is the sequence) on a
    mesh with a ``cp`` dim: each sequence in Megatron's load-balanced order, this rank's two chunks
    (``lmfunc.parallel.context``); ``batch`` itself without one."""
    if mesh is None or CP_DIM not in mesh.mesh_dim_names:
        return batch
    cp, rank = mesh.size(list(mesh.mesh_dim_names).index(CP_DIM)), mesh.get_local_rank(CP_DIM)
    return {k: context_part(v, cp, rank) for k, v in batch.items()}


def match_placements(grads: PyTree, params: PyTree) -> PyTree:
    """Redistribute each gradient to its parameter's placements (resolves ``Partial`` sums: the
    data-parallel all-reduce of replicated parameters), so optimizer state keeps its layout."""

    def match(g: Optional[torch.Tensor], p: torch.Tensor):
        if isinstance(g, DTensor) and list(g.placements) != list(p.placements):
            return g.redistribute(p.device_mesh, p.placements)
        return g

    return tree_map(match, grads, params)


def full_tensors(tree: PyTree) -> PyTree:
    """Every DTensor leaf gathered to a full plain tensor (a collective: call on every rank)."""
    return tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)
