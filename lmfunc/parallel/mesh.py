"""``build_mesh``: a named ``DeviceMesh`` in Megatron's rank order.

Megatron orders ranks with tensor parallelism fastest, then context, expert, data and pipeline
parallelism. The mesh here has the dims ``pp, dp_replicate, dp_shard, ep, cp, tp`` (outermost first),
so consecutive ranks differ in ``tp`` first; ``ep`` is the inner factor of the data-parallel shard
ranks (``ParallelConfig.sizes``). Only dims larger than 1 are created; a run whose sizes are
all 1 has no mesh and runs on plain tensors.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmfunc.config.parallel import MESH_DIMS, check_divisibility, data_parallel_size, resolve_sizes
from lmfunc.parallel.placement import DATA_PARALLEL_DIMS

__all__ = [
    "MESH_DIMS", "Layout", "build_mesh", "named_mesh", "use_compile_cache_for", "check_divisibility", "data_parallel_rank", "launched_world_size", "resolve_sizes",
]



def resolve_device(name: str) -> torch.device:
    """The device of this process for ``run.device``: 'auto' is cuda when a GPU is visible, else cpu;
    on cuda, GPU ``LOCAL_RANK`` of a torchrun launch (made the current device)."""
    from lmfunc.config.model import ConfigError

    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"run.device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "run.device is 'cuda' but no CUDA device is visible (torch.cuda.is_available() is False; this torch "
            f"build: {torch.__version__}, CUDA {torch.version.cuda}); install a CUDA build of torch, check "
            "CUDA_VISIBLE_DEVICES, or use --run.device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                          "launch at most one process per GPU (torchrun --nproc-per-node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """gloo on CPU, nccl on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The resolved mesh sizes of a run, its mesh (None on a single process) and this process's device."""

    sizes: dict
    mesh: Optional[DeviceMesh]
    device: torch.device = torch.device("cpu")

    @property
    def data_parallel_size(self) -> int:
        return data_parallel_size(self.sizes)

    def dims(self) -> tuple[str, ...]:
        return tuple(self.mesh.mesh_dim_names) if self.mesh is not None else ()


def launched_world_size() -> int:
    """The number of processes of this job: the process group's size, else torchrun's
    ``WORLD_SIZE``, else 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_mesh(sizes: dict[str, int], device: str | torch.device = "cpu") -> Layout:
    """Create the process group (from torchrun's environment) and the named mesh of ``sizes``.

    With every size 1 and no launcher, no process group is created and ``Layout.mesh`` is None.
    The process group's backend is NCCL on cuda and gloo on cpu (``backend_for``).
    """
    world = launched_world_size()
    resolved = resolve_sizes({name: sizes.get(name, 1) for name in MESH_DIMS}, world)
    device = torch.device(device)
    if all(size == 1 for size in resolved.values()):
        return Layout(resolved, None, device)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    mesh = named_mesh(resolved, device.type)
    use_compile_cache_for(mesh)
    return Layout(resolved, mesh, device)


def named_mesh(resolved: dict[str, int], device_type: str = "cpu") -> Optional[DeviceMesh]:
    """The ``DeviceMesh`` over the initialised process group with a dim for each size above 1 of
    ``resolved`` (``MESH_DIMS`` order, outermost first), or None when every size is 1."""
    used = [(name, resolved[name]) for name in MESH_DIMS if resolved.get(name, 1) > 1]
    if not used:
        return None
    return init_device_mesh(device_type, tuple(size for _, size in used), mesh_dim_names=tuple(name for name, _ in used))


def use_compile_cache_for(mesh: DeviceMesh) -> None:
    """Keep one Inductor cache directory for every rank of a 1-D mesh, and give each rank of a
    mesh with more dims its own. Whoever builds a mesh with ``init_device_mesh`` and compiles on it
    calls this after it (``build_mesh`` does).

    Compiled graphs embed the names of the process groups their collectives use, and those names
    differ between ranks of a 2-D mesh; torch 2.13's cache key leaves them out (it hashes the mesh's
    ranks and dims, not its groups), so with one shared cache rank 2 can load rank 0's graph and
    fail with "Could not resolve the process group registered under the name ...". On a 1-D mesh
    every rank's group is the world's, with the same name, so the ranks share the directory a single
    process uses (its precompiled header and CPU checks included), and the ranks of one CPU host
    compile one after another (``lmfunc.compiler.compiling.host_compile_turn``), unless the dim is
    a pipeline's: a graph every rank traces alike is compiled once and loaded from the cache by the
    others. A rank of a larger
    mesh keeps ``rank<r>/``, shared with the same rank of other jobs: on gloo a group's name is the
    count of groups made before it, the same for the same rank of the same mesh, and a mesh of
    other sizes or dims hashes to other keys."""
    from lmfunc.compiler.torch_compat.inductor import cache_dir

    base = cache_dir()
    if re.fullmatch(r"rank\d+", os.path.basename(base)):
        base = os.path.dirname(base)
    rank_dir = os.path.join(base, f"rank{dist.get_rank()}")
    one_dim = len(mesh.mesh_dim_names) == 1
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = base if one_dim else rank_dir
    _COMPILING_IN_TURN[0] = base if one_dim and mesh.mesh_dim_names[0] != "pp" else None


_COMPILING_IN_TURN: list[Optional[str]] = [None]
"""The Inductor cache directory whose ranks trace the same graphs and compile in turn (a 1-D mesh
that is not a pipeline's, whose stages' graphs differ), or None."""


def ranks_compile_in_turn() -> bool:
    """Whether this process's ranks trace alike and share the current Inductor cache directory, so
    that compiling in turn lets all but one load each graph (``use_compile_cache_for``)."""
    from lmfunc.compiler.torch_compat.inductor import cache_dir

    return _COMPILING_IN_TURN[0] is not None and _COMPILING_IN_TURN[0] == cache_dir()


def data_parallel_rank(layout: Layout) -> int:
    """This process's index among the data-parallel ranks (0 without a mesh): dp_replicate-major,
    then dp_shard, then ep, the order in which a batch split over the data-parallel dims is laid out."""
    if layout.mesh is None:
        return 0
    names, index = layout.dims(), 0
    for dim in DATA_PARALLEL_DIMS:
        index = index * layout.sizes.get(dim, 1) + (layout.mesh.get_local_rank(dim) if dim in names else 0)
    return index
