"""A target world on one process: a fake process group of ``world_size`` ranks in which this process
plays ``rank``, and the run's mesh on it. Collectives on it do nothing; they are only traced."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lmfunc.config.model import ConfigError
from lmfunc.parallel.mesh import named_mesh


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """While inside: the default process group is torch's fake backend with ``world_size`` ranks,
    this process being ``rank`` (nothing is sent; a collective returns its output buffer as it is)."""
    from lmfunc.compiler.torch_compat.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        raise ConfigError("a dry run starts its own (fake) process group: run it as one process, not under torchrun")
    _forget_meshes()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's caches of sharding decisions. They are keyed by mesh equality (shape, ranks,
    dim names), so a mesh of an earlier (fake) world that equals this one would hand its destroyed
    process groups to the next trace."""
    from lmfunc.compiler.torch_compat.distributed import (clear_fast_path_sharding_prop_cache, clear_python_sharding_prop_cache,
                                                   gen_transform_infos)

    clear_python_sharding_prop_cache()
    clear_fast_path_sharding_prop_cache()
    gen_transform_infos.cache_clear()


def mesh_of(sizes: dict[str, int]) -> Optional[DeviceMesh]:
    """The run's named mesh (``lmfunc.parallel.mesh.named_mesh``) on the current process group."""
    return named_mesh(sizes, "cpu")


def group_dims(mesh: Optional[DeviceMesh]) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Each process group this rank can use in a step, by name: the mesh dims it spans joined by
    ``+`` (``dp_shard+tp``), or ``world``; a group over part of such a set (a pipeline's embedding
    group) is named after the smallest one that holds it, ``pp (2 of its ranks)``; and the ranks of
    each."""
    names: dict[str, str] = {}
    world = list(range(dist.get_world_size()))
    if mesh is None:
        return {dist.group.WORLD.group_name: "world"}, {"world": world}
    dims = list(mesh.mesh_dim_names)
    coordinate = mesh.get_coordinate()
    by_ranks: dict[frozenset, str] = {}
    for mask in range(1, 2 ** len(dims)):
        spanned = [d for i, d in enumerate(dims) if mask >> i & 1]
        index = tuple(slice(None) if d in spanned else coordinate[i] for i, d in enumerate(dims))
        by_ranks[frozenset(mesh.mesh[index].flatten().tolist())] = "+".join(spanned)
    from lmfunc.compiler.torch_compat.distributed import c10d_world

    dims_ranks = {dims: sorted(members) for members, dims in by_ranks.items()} | {"world": world}
    for group in list(c10d_world.pg_names):
        try:
            ranks = frozenset(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError):  # a group this rank is not in
            continue
        if ranks in by_ranks:
            names.setdefault(group.group_name, by_ranks[ranks])
            continue
        holders = [dims for dims, members in dims_ranks.items() if ranks <= set(members)]
        if holders:  # e.g. a pipeline's embedding group: its first and last stage
            outer = min(holders, key=lambda dims: len(dims_ranks[dims]))
            name = f"{outer} ({len(ranks)} of its ranks)"
            names[group.group_name], dims_ranks[name] = name, sorted(ranks)
    names.setdefault(dist.group.WORLD.group_name, "world")
    return names, dims_ranks
