"""The compiled step's reduce-scatters on a gloo process group, as all-to-alls.

gloo has no reduce-scatter; c10d all-reduces the whole tensor and keeps one chunk, moving twice
the bytes a reduce-scatter needs. On a gloo group each reduce-scatter (the FSDP buckets and
sequence parallelism's) becomes an all-to-all (every rank receives the other ranks' copies of its
own chunk) followed by a local sum over the ranks, in rank order: the bytes of a ring
reduce-scatter. With 2 ranks the sum is the same single addition, so the result is bitwise the
all-reduce's. ``lmfunc.compiler.collective_buckets`` applies it after bucketing.

A dry run (``lmfunc.dryrun``) traces on torch's fake process group, which stands for a GPU run's
NCCL: its reduce-scatters stay. Inside ``as_if_gloo`` they are rewritten as on gloo, so that a dry
run of a CPU run has the collectives and buffers that run has.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import fx

from lmfunc.compiler.torch_compat.distributed import resolve_process_group
from lmfunc.compiler.torch_compat.inductor import is_all_to_all_tensor, is_wait_tensor, process_collective_bucket, resolve_group_name
from lmfunc.compiler.torch_compat.tensors import c10d_functional


def wait_of(collective: fx.Node) -> fx.Node:
    """The ``wait_tensor`` of a functional collective."""
    return next(user for user in collective.users if is_wait_tensor(user))


_every_group_gloo = False


@contextlib.contextmanager
def as_if_gloo() -> Iterator[None]:
    """While inside, every process group counts as gloo here (``on_gloo``): a dry run of a CPU run."""
    global _every_group_gloo
    before, _every_group_gloo = _every_group_gloo, True
    try:
        yield
    finally:
        _every_group_gloo = before


def on_gloo(collective: fx.Node) -> bool:
    """Whether the collective runs on a gloo process group (CPU tensors), or inside ``as_if_gloo``."""
    import torch.distributed as dist

    if _every_group_gloo:
        return True
    try:
        group = resolve_process_group(resolve_group_name(collective.args[-1]))
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError, KeyError):
        return False


def _reduce_scatter_by_all_to_all(inputs: list[torch.Tensor], group_name: Any, group_size: int,
                                  reduce_op: str) -> list[torch.Tensor]:
    """A reduce-scatter of ``inputs[0]`` ``[group_size * n, ...]`` as an all-to-all and a sum over
    the received ``[group_size, n, ...]`` copies of this rank's chunk: ``[n, ...]``."""
    x = inputs[0]
    chunk = x.shape[0] // group_size
    received = c10d_functional.wait_tensor(c10d_functional.all_to_all_single(
        x, [chunk] * group_size, [chunk] * group_size, group_name))
    total = received.view(group_size, chunk, *x.shape[1:]).sum(0)
    return [total / group_size if reduce_op == "avg" else total]


def reduce_scatter_as_all_to_all(graph: fx.Graph, reduce_scatter: fx.Node) -> fx.Node:
    """Replace a gloo reduce-scatter (sum or avg) by ``_reduce_scatter_by_all_to_all``, issued where
    it was and waited for where its wait was; returns the all-to-all (or the reduce-scatter itself
    where the rewrite does not apply)."""
    _, reduce_op, group_size, group_name = reduce_scatter.args
    if reduce_op not in ("sum", "avg") or not isinstance(group_name, str) or not on_gloo(reduce_scatter):
        return reduce_scatter
    new_nodes, _ = process_collective_bucket(
        graph, [reduce_scatter], _reduce_scatter_by_all_to_all,
        lambda inputs: ([inputs[0].meta["val"]], group_name, group_size, reduce_op),
        insert_before=reduce_scatter.next, wait_insertion_point=wait_of(reduce_scatter))
    return next(n for n in new_nodes if is_all_to_all_tensor(n))
