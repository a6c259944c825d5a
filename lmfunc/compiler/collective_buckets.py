"""Bucketing and overlap of the step's data-parallel collectives, as an Inductor post-grad pass.

With FSDP placements, DTensor gathers each parameter where a layer uses it and reduce-scatters its
gradient in the backward: one all-gather and one reduce-scatter per parameter use, each waited
for at once. This pass rewrites the compiled step's graph the way torchtitan's FSDP2 and
SimpleFSDP run:

- **per region**: the model marks its regions (``lmfunc.parallel.placement.region``: ``embed``,
  ``layers.<i>``, ``head``). The all-gathers of one region's parameters become one all-gather
  (Inductor's ``merge_all_gather_bucket``: the shards are copied into one buffer, gathered, and
  split again), and the reduce-scatters of their gradients one reduce-scatter
  (``merge_reduce_scatter_bucket``). A gradient's region is its parameter's: the reduce-scatter's
  output is followed, through same-shape elementwise ops, to the optimizer update that reads the
  parameter itself (the backward's nodes carry no region marks).
- **prefetch**: region ``i + 1``'s all-gather is issued before the wait of region ``i``'s, so it
  runs while region ``i`` computes; at most two regions' parameters are gathered at once.
- **deferred waits**: region ``i``'s reduce-scatter is issued before the first matmul after it
  (region ``i - 1``'s backward) and waited for only after region ``i - 1``'s has been issued
  (backward order), so it runs during that region's backward; at most two regions' full
  gradients are alive at once.
- **HSDP: the shard's reduction first**: DTensor reduces a gradient that is partial over both the
  replicas and the shards by all-reducing the full gradient over the replicas, then
  reduce-scattering it over the shards. Sums commute, so the pass reduce-scatters first and
  all-reduces only this rank's shard over the replicas (FSDP2's HSDP order): the replicas'
  all-reduce, the one that crosses nodes, moves ``1 / dp_shard`` of the bytes. The ops between the
  two (DTensor's split and concatenation for a shard on another dim than 0) only move elements.
  Each region's replica all-reduces form one bucket, issued when its reduce-scatter is done.
- **all-reduces** (``dp_replicate``: the step's gradients) are merged into buckets of at most
  ``bucket_size_mb`` MiB (Megatron's ``--ddp-bucket-size``) in the order their inputs are ready;
  each is issued as soon as its last input is, and waited for where its result is first used.
- **gloo's reduce-scatter** becomes an all-to-all and a local sum (``lmfunc.compiler.gloo_reduce_scatter``).

Gather and reduce-scatter buckets are runs of consecutive collectives (in graph order) of one
region and one process group, so the collective order is the same on every rank. A run ends
where a microbatch starts (``lmfunc.compiler.accumulation_order.mark_microbatch``): the tied
embedding's two gradient reductions, one at the end of a microbatch's backward and one at the
start of the next's, stay two, so that each microbatch's gradients are summed before the next
begins and every microbatch issues the same collectives. The numbers do not change: a bucketed
collective moves the same values and reduces each element over the same ranks; the HSDP swap sums
each element over the same ranks in another order (rel 1e-7 in fp32).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import fx

from lmfunc.compiler.torch_compat.inductor import (
    CustomGraphPass,
    OrderedSet,
    get_hash_for_files,
    is_all_gather_into_tensor,
    is_all_reduce_tensor,
    is_reduce_scatter_tensor,
    is_wait_tensor,
    merge_all_gather_bucket,
    merge_all_reduce_bucket,
    merge_reduce_scatter_bucket,
    preserve_node_ordering,
    stable_topological_sort,
)
from lmfunc.compiler.torch_compat.tensors import c10d_functional

from lmfunc.compiler import accumulation_order, gloo_reduce_scatter
from lmfunc.compiler.accumulation_order import microbatch_starts, reachable
from lmfunc.compiler.gloo_reduce_scatter import reduce_scatter_as_all_to_all, wait_of
from lmfunc.parallel.placement import REGION_KEY

DEFAULT_BUCKET_MB = 40.0
"""Default largest data-parallel all-reduce bucket in MiB (``ParallelConfig.bucket_size_mb``)."""
_FOLLOW_LIMIT = 400  # nodes visited per gradient while looking for its parameter


def _region(node: fx.Node) -> Optional[str]:
    custom = node.meta.get("custom")
    return custom.get(REGION_KEY) if isinstance(custom, dict) else None


def gathered_placeholder(all_gather: fx.Node) -> Optional[fx.Node]:
    """The graph input an all-gather gathers, through single-input ops (casts, views), or None
    (an activation's all-gather): a parameter's FSDP gather when that input is a parameter."""
    x = all_gather.args[0]
    while isinstance(x, fx.Node) and x.op == "call_function" and len(x.all_input_nodes) == 1:
        x = x.all_input_nodes[0]
    return x if isinstance(x, fx.Node) and x.op == "placeholder" else None


def _shape(node: fx.Node) -> Optional[tuple]:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _elementwise_steps(node: fx.Node, shape: tuple) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Where ``node``'s value goes elementwise: ``(successor, what it is combined with)`` for each
    same-shape user, and for a foreach op the output at ``node``'s position in its lists (with the
    other lists' items at that position)."""
    steps = []
    for user in node.users:
        if isinstance(user.meta.get("val"), (list, tuple)):
            lists = [arg for arg in user.args if isinstance(arg, (list, tuple))]
            for position in {i for arg in lists for i, item in enumerate(arg) if item is node}:
                partners = [arg[position] for arg in lists if isinstance(arg[position], fx.Node)]
                steps += [(out, partners) for out in user.users
                          if out.target is operator.getitem and out.args[1] == position and _shape(out) == shape]
        elif _shape(user) == shape:
            steps.append((user, user.all_input_nodes))
    return steps


def _gradient_region(reduce_scatter: fx.Node, regions: dict[fx.Node, str]) -> Optional[str]:
    """The region of the parameter whose gradient ``reduce_scatter`` reduces: the first gathered
    parameter that the gradient is combined with, following it elementwise (the optimizer's
    update reads the parameter); None when none is met."""
    shape = _shape(reduce_scatter)
    frontier, seen = [reduce_scatter], {reduce_scatter}
    while frontier and len(seen) < _FOLLOW_LIMIT:
        following = []
        for node in frontier:
            for successor, partners in _elementwise_steps(node, shape):
                for partner in partners:
                    if partner in regions:
                        return regions[partner]
                if successor not in seen:
                    seen.add(successor)
                    following.append(successor)
        frontier = following
    return None


def _group(node: fx.Node) -> Any:
    return str(node.args[-1])


def _runs(nodes: list[tuple[fx.Node, Optional[str]]], barriers: frozenset[int] = frozenset()) -> list[list[fx.Node]]:
    """Maximal runs of consecutive collectives with the same region and process group, none
    across a node whose graph position is in ``barriers``; those without a region are left out."""
    runs: list[list[fx.Node]] = []
    key, previous = None, None
    position = {n: i for i, n in enumerate(nodes[0][0].graph.nodes)} if nodes and barriers else {}
    for node, region in nodes:
        this = (region, _group(node)) if region is not None else None
        crossed = barriers and previous is not None and any(position[previous] < b < position[node] for b in barriers)
        if this is not None and this == key and not crossed:
            runs[-1].append(node)
        elif this is not None:
            runs.append([node])
        key, previous = this, node
    return runs


_MOVES = {
    torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, operator.getitem,
    torch.ops.aten.cat.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default, torch.ops.aten.clone.default,
}
"""Ops that only move elements: a sum over ranks commutes with them."""


def _reduced_source(reduce_scatter: fx.Node) -> Optional[fx.Node]:
    """The wait of an all-reduce whose result, only rearranged by element-moving ops and used
    nowhere else, is ``reduce_scatter``'s input; otherwise None."""
    between, sources, stack = set(), set(), [reduce_scatter.args[0]]
    while stack:
        node = stack.pop()
        if node in between or node in sources:
            continue
        if is_wait_tensor(node) and is_all_reduce_tensor(node.args[0]):
            sources.add(node)
        elif node.op == "call_function" and node.target in _MOVES:
            between.add(node)
            stack.extend(node.all_input_nodes)
        else:
            return None
    if len(sources) != 1:
        return None
    wait = sources.pop()
    inside = between | {reduce_scatter}
    if len(wait.args[0].users) != 1 or any(user not in inside for n in between | {wait} for user in n.users):
        return None
    return wait


def _reduce_shard_before_replicas(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Rewrite each ``reduce_scatter(moves(all_reduce(g)))`` (sum or avg) as
    ``all_reduce(reduce_scatter(moves(g)))``: the all-reduce then moves one shard, not the whole
    gradient. Only across two process groups (two mesh dims): over one group, all-reducing the
    scattered chunks would sum different chunks. Returns each new all-reduce's reduce-scatter."""
    swapped = {}
    for reduce_scatter in [n for n in graph.nodes if is_reduce_scatter_tensor(n)]:
        wait = _reduced_source(reduce_scatter)
        if wait is None:
            continue
        all_reduce = wait.args[0]
        gradient, replica_args = all_reduce.args[0], all_reduce.args[1:]
        if (replica_args[0] not in ("sum", "avg") or reduce_scatter.args[1] not in ("sum", "avg")
                or _group(all_reduce) == _group(reduce_scatter)):
            continue
        wait.replace_all_uses_with(gradient)
        graph.erase_node(wait)
        graph.erase_node(all_reduce)
        scattered = wait_of(reduce_scatter)
        with graph.inserting_after(scattered):
            shard_reduce = graph.call_function(c10d_functional.all_reduce.default,
                                               (scattered, *replica_args))
        with graph.inserting_after(shard_reduce):
            reduced = graph.call_function(c10d_functional.wait_tensor.default, (shard_reduce,))
        for node in (shard_reduce, reduced):
            node.meta["val"] = scattered.meta["val"]
        scattered.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not shard_reduce)
        swapped[shard_reduce] = reduce_scatter
    return swapped


def _issue_ahead(graph: fx.Graph, buckets: list[fx.Node]) -> None:
    """Move each all-gather bucket (its start and the copies that feed it) before the previous
    bucket's wait, so it is in flight while the previous region computes."""
    for previous, current in zip(buckets, buckets[1:]):
        position = {n: i for i, n in enumerate(graph.nodes)}
        wait = wait_of(previous)
        if position[current] < position[wait]:
            continue
        feeding, stack = set(), [current]
        while stack:
            node = stack.pop()
            if node in feeding or node.op == "placeholder" or position[node] < position[wait]:
                continue
            feeding.add(node)
            stack.extend(node.all_input_nodes)
        for node in sorted(feeding, key=position.__getitem__):
            wait.prepend(node)


def _defer_waits(graph: fx.Graph, buckets: list[fx.Node]) -> None:
    """Move each reduce-scatter bucket's wait after the next bucket's start: one region's
    reduction runs during the next region's backward."""
    for current, following in zip(buckets, buckets[1:]):
        wait = wait_of(current)
        position = {n: i for i, n in enumerate(graph.nodes)}
        if position[wait] < position[following]:
            following.append(wait)


def _issue_before_next_matmul(graph: fx.Graph, buckets: list[fx.Node]) -> dict[fx.Node, OrderedSet]:
    """Control edges that keep each reduce-scatter bucket (but the last) issued before the first
    matmul after it in graph order: the next region's backward. Without them Inductor's
    peak-memory reordering sinks the issues (with their send buffers) to the end of the backward,
    where nothing is left to overlap them with."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    matmuls = [n for n in graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                                      torch.ops.aten.bmm.default)]
    edges: dict[fx.Node, OrderedSet] = {}
    for bucket in buckets[:-1]:
        anchor = next((m for m in matmuls if position[m] > position[bucket]), None)
        if anchor is not None:
            edges.setdefault(anchor, OrderedSet()).add(bucket)
    return edges


def _descendants(node: fx.Node) -> set[fx.Node]:
    return reachable([node], lambda n: n.users)


def _without_cycles(graph: fx.Graph, order: dict[fx.Node, OrderedSet]) -> dict[fx.Node, OrderedSet]:
    """``order`` (each node to run after the nodes it maps to) less the edges that would close a
    cycle: a bucket that reads the one before it (a leaf split over two mesh dims is gathered over
    one, then over the other, and its gradient reduced the same way) cannot be issued before that
    one's wait. ``graph`` is in topological order, so only the nodes between the two are searched."""
    position = {n: i for i, n in enumerate(graph.nodes)}

    def reads(later: fx.Node, earlier: fx.Node) -> bool:
        seen, stack = set(), [later]
        while stack:
            node = stack.pop()
            if node is earlier:
                return True
            if node not in seen and position[node] > position[earlier]:
                seen.add(node)
                stack.extend(node.all_input_nodes)
        return False

    kept = {node: OrderedSet(b for b in before if not reads(b, node)) for node, before in order.items()}
    return {node: before for node, before in kept.items() if before}


def _bucket_all_reduces(graph: fx.Graph, bucket_size_mb: float, scatter_bucket: dict[fx.Node, int]) -> None:
    """Merge the all-reduces into buckets of at most ``bucket_size_mb`` MiB: consecutive ones (in
    the order their inputs are ready) of one process group, reduce op and dtype, none depending
    on another of its bucket, and (HSDP) reducing the shards of one reduce-scatter bucket
    (``scatter_bucket``: an all-reduce's reduce-scatter bucket index). Each bucket is issued as
    soon as its last input is ready and waited for where its first result is used, so it runs
    during the rest of the backward."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    all_reduces = [n for n in graph.nodes if is_all_reduce_tensor(n)]
    ready = {n: max((position[i] for i in n.all_input_nodes), default=0) for n in all_reduces}
    buckets: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    size, key, blocked = 0, None, set()
    for node in sorted(all_reduces, key=ready.__getitem__):
        this_key = (_group(node), node.args[1], node.meta["val"].dtype, scatter_bucket.get(node))
        nbytes = node.meta["val"].numel() * node.meta["val"].element_size()
        if current and (this_key != key or node in blocked or size + nbytes > bucket_size_mb * 2**20):
            buckets.append(current)
            current, size, blocked = [], 0, set()
        current.append(node)
        size, key = size + nbytes, this_key
        blocked |= _descendants(node)
    buckets.append(current)
    for bucket in buckets:
        if len(bucket) < 2:
            continue
        last_input = max((i for n in bucket for i in n.all_input_nodes), key=position.__getitem__)
        first_wait = min((wait_of(n) for n in bucket), key=position.__getitem__)
        wait_at = first_wait if position[first_wait] > position[last_input] else None
        merge_all_reduce_bucket(graph, bucket, insert_before=last_input.next, wait_insertion_point=wait_at)
        stable_topological_sort(graph)
        position = {n: i for i, n in enumerate(graph.nodes)}


def bucket_collectives(graph: fx.Graph, bucket_size_mb: float) -> None:
    """Rewrite ``graph`` in place as the module docstring says."""
    replica_reductions = _reduce_shard_before_replicas(graph)
    nodes = list(graph.nodes)
    all_gathers = [n for n in nodes if is_all_gather_into_tensor(n)]
    regions: dict[fx.Node, str] = {}
    for node in all_gathers:
        source, region = gathered_placeholder(node), _region(node)
        if source is not None and region is not None:
            regions.setdefault(source, region)
    fsdp_gathers = [(n, _region(n)) for n in all_gathers if gathered_placeholder(n) in regions]
    gather_buckets = []
    for run in _runs(fsdp_gathers):
        if len(run) > 1:
            first_wait = min((wait_of(n) for n in run), key=nodes.index)
            new_nodes, _ = merge_all_gather_bucket(graph, run, insert_before=run[0].next, wait_insertion_point=first_wait)
            run = [next(n for n in new_nodes if is_all_gather_into_tensor(n))]
        gather_buckets.append(run[0])
    reductions = [(n, _gradient_region(n, regions)) for n in graph.nodes if is_reduce_scatter_tensor(n)]
    scatter_buckets, bucket_of = [], {}
    for run in _runs(reductions, microbatch_starts(graph)):
        bucket_of |= dict.fromkeys(run, len(scatter_buckets))
        if len(run) > 1:
            new_nodes, _ = merge_reduce_scatter_bucket(graph, run, insert_before=run[-1].next)
            run = [next(n for n in new_nodes if is_reduce_scatter_tensor(n))]
        scatter_buckets.append(reduce_scatter_as_all_to_all(graph, run[0]))
    stable_topological_sort(graph)
    _issue_ahead(graph, gather_buckets)
    _defer_waits(graph, scatter_buckets)
    stable_topological_sort(graph)
    # Inductor's scheduler reorders for peak memory; these edges keep the overlap it would undo.
    order = {wait_of(previous): OrderedSet([current]) for previous, current in zip(gather_buckets, gather_buckets[1:])}
    order |= {wait_of(current): OrderedSet([following]) for current, following in zip(scatter_buckets, scatter_buckets[1:])}
    order |= _issue_before_next_matmul(graph, scatter_buckets)
    preserve_node_ordering(graph, _without_cycles(graph, order))
    _bucket_all_reduces(graph, bucket_size_mb, {all_reduce: bucket_of.get(reduce_scatter)
                                                for all_reduce, reduce_scatter in replica_reductions.items()})
    for node in [n for n in graph.nodes if is_reduce_scatter_tensor(n)]:
        reduce_scatter_as_all_to_all(graph, node)
    graph.lint()


class CollectiveBucketsPass(CustomGraphPass):
    """``bucket_collectives`` as an Inductor ``post_grad_custom_post_pass``; its ``uuid`` (in the
    compile caches' keys) hashes this file, the gloo rewrite's and the bucket size."""

    def __init__(self, bucket_size_mb: float = DEFAULT_BUCKET_MB):
        self.bucket_size_mb = bucket_size_mb

    def __call__(self, graph: fx.Graph) -> None:
        if any(n.op == "call_function" and "_c10d_functional" in str(n.target) for n in graph.nodes):
            bucket_collectives(graph, self.bucket_size_mb)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, gloo_reduce_scatter.__file__, accumulation_order.__file__)) + repr(self.bucket_size_mb).encode()
