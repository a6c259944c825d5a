"""Each microbatch's gradients added to the sum before the next microbatch starts.

The train step sums its microbatches' gradients with one ``_foreach_add`` per microbatch,
``acc_k = acc_(k-1) + g_k``. Inductor inlines an elementwise result that only one elementwise op
reads into that op, and fuses elementwise kernels along a chain, so the chain becomes a single
kernel at the end of the step, ``g_1 + g_2 + ... + g_M``, and every microbatch's gradients stay
alive until then: the peak grows by one set of gradients per microbatch (with FSDP, one set of
reduce-scattered shards; Llama-3-8B on ``dp_shard`` 8: 0.35 GiB each, 22 GiB at 64 microbatches).
Megatron and FSDP2 add each microbatch's gradients into their buffers as they come.

``mark_accumulation(k)`` annotates the ``k``-th sum (``torch.fx.traceback.annotate``);
``order_accumulations`` then makes the first matmul of the graph that runs after sum ``k`` and
that sum ``k + 1`` needs (the next microbatch's first) depend on sum ``k``'s results
(``control_deps``). Inductor realizes a ``control_deps`` input as its own buffer, and fusing sum
``k`` into sum ``k + 1`` would now be a cycle, so sum ``k`` runs between the microbatches and
``g_k`` is freed there. The values are the same: the same additions in the same order.

``mark_microbatch(k)`` marks where microbatch ``k`` starts (its slice of the batch): the collective
pass ends a bucket of gradient reductions there. A bucket across two microbatches (the tied
embedding's two reductions, one at the end of a microbatch's backward and one at the start of the
next's) would hold the first's gradients until the next one's backward, after the sum.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable, Iterable, Iterator

import torch
from torch import fx
from lmfunc.compiler.torch_compat.inductor import CustomGraphPass, get_hash_for_files
from lmfunc.compiler.torch_compat.inductor import preserve_node_ordering
from torch.fx.traceback import annotate
from lmfunc.compiler.torch_compat.inductor import OrderedSet

ACCUMULATION_KEY = "lmfunc_gradient_sum"
MICROBATCH_KEY = "lmfunc_microbatch"
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@contextlib.contextmanager
def mark_accumulation(index: int) -> Iterator[None]:
    """Mark what is traced inside as the step's ``index``-th sum of microbatch gradients; a no-op
    for eager execution."""
    with annotate({ACCUMULATION_KEY: index}):
        yield


@contextlib.contextmanager
def mark_microbatch(index: int) -> Iterator[None]:
    """Mark what is traced inside as the start of the step's ``index``-th microbatch (its slice of
    the batch); a no-op for eager execution. ``lmfunc.compiler.collective_buckets`` ends a bucket of
    gradient reductions there, so that no bucket spans two microbatches."""
    with annotate({MICROBATCH_KEY: index}):
        yield


def microbatch_starts(graph: fx.Graph) -> frozenset[int]:
    """The graph positions of the nodes marked by ``mark_microbatch``."""
    return frozenset(i for i, node in enumerate(graph.nodes) if MICROBATCH_KEY in node.meta.get("custom", {}))


def _sums(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    """The marked nodes of ``graph`` by sum index, in graph order."""
    sums: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        index = node.meta.get("custom", {}).get(ACCUMULATION_KEY)
        if node.op == "call_function" and index is not None:
            sums.setdefault(index, []).append(node)
    return dict(sorted(sums.items()))


def _results(nodes: list[fx.Node]) -> OrderedSet[fx.Node]:
    """The tensors a sum's nodes hand on: the items of a list result, else the node itself."""
    results: OrderedSet[fx.Node] = OrderedSet()
    for node in nodes:
        if isinstance(node.meta.get("val"), torch.Tensor):
            results.add(node)
        results.update(u for u in node.users
                       if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor))
    return results


def reachable(starts: list[fx.Node], neighbours: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """The nodes reached from ``starts`` by one or more ``neighbours`` steps (``lambda n:
    n.all_input_nodes``: the ancestors; ``lambda n: n.users``: the descendants)."""
    found, stack = set(), list(starts)
    while stack:
        for node in neighbours(stack.pop()):
            if node not in found:
                found.add(node)
                stack.append(node)
    return found


def order_accumulations(graph: fx.Graph) -> int:
    """Make the first matmul after each marked sum (but the last) that the next sum needs depend
    on the sum's results (module docstring); returns how many sums were so ordered. A sum with no
    such matmul after it is left as it is."""
    sums = list(_sums(graph).values())
    position = {node: i for i, node in enumerate(graph.nodes)}
    edges: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for current, following in zip(sums, sums[1:]):
        needed = reachable(following, lambda n: n.all_input_nodes)
        after = max(position[n] for n in current)
        anchor = next((n for n in graph.nodes if n.target in MATMULS and position[n] > after and n in needed), None)
        results = _results(current)
        if anchor is not None and results:
            edges[anchor] = results
    preserve_node_ordering(graph, edges)
    return len(edges)


class AccumulationOrderPass(CustomGraphPass):
    """``order_accumulations`` as an Inductor post-grad pass; its ``uuid`` hashes this file."""

    def __call__(self, graph: fx.Graph) -> None:
        order_accumulations(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
