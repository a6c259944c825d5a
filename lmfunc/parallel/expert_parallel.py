"""Expert parallelism: tokens to their experts' ranks and back, by all-to-all with autograd.

With ``ep`` ranks the E routed experts of a layer are split into ``ep`` contiguous blocks of
``E / ep`` (rank r holds experts ``r * E/ep ...``; ``lmfunc.parallel.sharding.EP_RULES``). These
functions run on each rank's local tensors, inside ``lmfunc.parallel.placement.run_on_tokens``,
over the ``ep`` dim of the mesh (``ExpertGroup``); ``torch.distributed._functional_collectives``
gives the all-to-alls their backward (the reverse all-to-all) and lets ``torch.compile`` trace
them.

- ``dispatch_sorted`` / ``combine_sorted`` (dropless): the rows of the (token, expert) pairs,
  sorted by expert, go to the rank of their expert; the number of rows each rank receives is
  known only after the counts are exchanged, so the row all-to-all's sizes are data-dependent
  (Megatron's dropless all-to-all dispatcher does the same; compiled, they are unbacked sizes).
- ``dispatch_slots`` / ``combine_slots`` (capacity): every expert's ``[C, h]`` slot buffer goes to
  its rank, a static shape (GShard's dispatch).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from lmfunc.compiler.torch_compat.tensors import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lmfunc.parallel.placement import EP_DIM


class ExpertGroup(NamedTuple):
    """The ``ep`` dim of a mesh: the collectives' group (``(mesh, dim index)``) and its size."""

    mesh: DeviceMesh
    dim: int
    size: int

    @property
    def group(self) -> tuple[DeviceMesh, int]:
        return self.mesh, self.dim


def expert_group(x: torch.Tensor) -> Optional[ExpertGroup]:
    """The ``ep`` dim of the mesh ``x`` (a DTensor) lives on; None without one."""
    if not isinstance(x, DTensor) or EP_DIM not in (x.device_mesh.mesh_dim_names or ()):
        return None
    dim = list(x.device_mesh.mesh_dim_names).index(EP_DIM)
    return ExpertGroup(x.device_mesh, dim, x.device_mesh.size(dim))


class Dispatched(NamedTuple):
    """What ``combine_sorted`` needs to send the expert outputs back: the permutation that sorted
    the received rows by local expert, and the row counts sent to and received from each rank."""

    order: torch.Tensor
    sent: list
    received: list


def dispatch_sorted(rows: torch.Tensor, counts: torch.Tensor, ep: ExpertGroup) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
    """Send ``rows`` ``[N, h]`` (sorted by expert; ``counts`` ``[E]`` int64 rows per expert) to
    their experts' ranks. Returns the rows this rank received ``[R, h]``, sorted by its local
    expert (and within one, by source rank, then by the source's order: the order one process
    would see them in), the rows per local expert ``[E / ep]`` (int64), and the ``Dispatched``
    that ``combine_sorted`` takes."""
    local_experts = counts.shape[0] // ep.size
    received_counts = all_to_all_single(counts, None, None, ep.group).view(ep.size, local_experts)
    sent = counts.view(ep.size, local_experts).sum(dim=1).tolist()
    received = received_counts.sum(dim=1).tolist()
    arrived = all_to_all_single_autograd(rows, received, sent, ep.group)
    expert_of_row = torch.repeat_interleave(
        torch.arange(local_experts, device=rows.device).repeat(ep.size), received_counts.reshape(-1),
        output_size=arrived.shape[0])
    order = torch.argsort(expert_of_row, stable=True)
    return arrived[order], received_counts.sum(dim=0), Dispatched(order, sent, received)


def combine_sorted(out: torch.Tensor, dispatched: Dispatched, ep: ExpertGroup) -> torch.Tensor:
    """The expert outputs ``[R, h]`` (in ``dispatch_sorted``'s order) back on the ranks their
    rows came from: ``[N, h]`` in the order of the rows sent."""
    unsorted = torch.zeros_like(out).index_copy(0, dispatched.order, out)
    return all_to_all_single_autograd(unsorted, dispatched.sent, dispatched.received, ep.group)


def dispatch_slots(buffer: torch.Tensor, ep: ExpertGroup) -> torch.Tensor:
    """Every expert's slots ``[E, C, h]`` to its rank: this rank's experts' slots from every rank,
    ``[E / ep, ep * C, h]`` (source-rank-major within an expert)."""
    experts, capacity, hidden = buffer.shape
    arrived = all_to_all_single_autograd(buffer.contiguous(), None, None, ep.group)
    return arrived.view(ep.size, experts // ep.size, capacity, hidden).transpose(0, 1).reshape(
        experts // ep.size, ep.size * capacity, hidden)


def combine_slots(out: torch.Tensor, ep: ExpertGroup) -> torch.Tensor:
    """The outputs ``[E / ep, ep * C, h]`` of ``dispatch_slots``' slots back to their ranks:
    ``[E, C, h]``, in the layout of the buffer sent."""
    local_experts, slots, hidden = out.shape
    capacity = slots // ep.size
    parts = out.view(local_experts, ep.size, capacity, hidden).transpose(0, 1).contiguous()
    back = all_to_all_single_autograd(parts.view(ep.size * local_experts * capacity, hidden), None, None, ep.group)
    return back.view(ep.size * local_experts, capacity, hidden)
