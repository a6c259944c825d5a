"""The process groups a pipeline step talks over: the pipeline group and the data mesh beside it,
Megatron's embedding group (the first and last stage at one data- and tensor-parallel coordinate),
and how many data-parallel parts a batch has."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lmfunc.config.parallel import data_parallel_size as config_data_parallel_size


def pipeline_groups(group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh]):
    """The pipeline group and the data mesh (the mesh without ``pp``; None when it has no other dim)
    of a step built over ``group`` or ``mesh``."""
    if mesh is None:
        return (group if group is not None else dist.group.WORLD), None
    if group is not None:
        raise ValueError("give the pipeline step a process group or a mesh, not both")
    names = tuple(mesh.mesh_dim_names)
    if "pp" not in names:
        raise ValueError(f"the pipeline step's mesh needs a 'pp' dim, got dims {names}")
    others = tuple(name for name in names if name != "pp")
    return mesh.get_group("pp"), (mesh[others] if others else None)


def data_parallel_size(data_mesh: Optional[DeviceMesh]) -> int:
    """How many data-parallel parts a batch has on ``data_mesh`` (1 without one)."""
    if data_mesh is None:
        return 1
    sizes = {name: data_mesh.size(dim) for dim, name in enumerate(data_mesh.mesh_dim_names)}
    return int(config_data_parallel_size(sizes))


def embedding_group(group: dist.ProcessGroup, mesh: Optional[DeviceMesh], ranks: list[int]):
    """Megatron's embedding group: the pipeline ranks ``ranks`` (first and last stage) at this
    process's data- and tensor-parallel coordinates. Every process creates every coordinate's group
    (``new_group`` is collective over the world) and keeps its own."""
    if mesh is None:
        return dist.new_group([dist.get_global_rank(group, r) for r in ranks])
    grid = mesh.mesh.movedim(list(mesh.mesh_dim_names).index("pp"), 0)
    grid = grid.reshape(grid.shape[0], -1)
    mine = None
    for column in range(grid.shape[1]):
        members = [int(grid[r, column]) for r in ranks]
        created = dist.new_group(members)
        if dist.get_rank() in members:
            mine = created
    return mine
