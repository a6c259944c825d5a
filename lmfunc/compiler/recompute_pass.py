"""Activation recompute inside the one compiled train step: an Inductor graph pass.

Under ``torch.compile`` the train step is a single forward-loss-backward graph (``autograd.grad``
is traced into it), so AOTAutograd's partitioner never runs. Ops inside
``lmfunc.model.recompute.checkpointed`` regions arrive tagged "recompute"; this pass copies them
into each backward pass (one per microbatch) right before their first use there and lets dead-code elimination
drop the stored forward copies, so only the region inputs stay alive between forward and backward.
The forward's all-gathers (FSDP's parameter gathers, sequence parallelism's input gathers, context
parallelism's key and value gathers) are tagged the same way (``lmfunc.compiler.regather``): each backward gathers the shards again.

torch 2.13 ships a pass for this (``remat_using_tags_for_fwd_loss_bwd_graph``), but it accepts a
single backward region — one microbatch — and refuses every op tagged ``nondeterministic_seeded``,
which includes the CPU flash-attention kernel even at ``dropout_p = 0``. This pass handles one
backward pass per microbatch and accepts attention kernels whose dropout is 0 (lmfunc's own
dropout is a pure function of its seed, so recomputing it is exact).
``lmfunc.compiler.compiling`` turns the built-in pass off for the step and installs this
one.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from lmfunc.compiler.torch_compat.tracing import cleanup_recompute_tags, must_recompute
from lmfunc.compiler.torch_compat.inductor import CustomGraphPass, get_hash_for_files

from lmfunc.compiler import collective_buckets, cpp_flags, inplace_reuse, regather, saved_values
from lmfunc.compiler.saved_values import is_backward, tag_recompute


def _dropout_p(node: fx.Node) -> float:
    schema = node.target._schema
    for index, argument in enumerate(schema.arguments):
        if argument.name == "dropout_p":
            if index < len(node.args):
                return float(node.args[index])
            return float(node.kwargs.get("dropout_p", 0.0))
    return 1.0


def check_randomness(nodes: list[fx.Node]) -> None:
    for node in nodes:
        tags = getattr(node.target, "tags", ())
        if must_recompute(node) and torch.Tag.nondeterministic_seeded in tags and _dropout_p(node) != 0.0:
            raise RuntimeError(
                f"activation recompute: {node.target} draws from the global RNG inside a recomputed region, so its "
                "recomputation would differ; use lmfunc's seeded dropout (layers.dropout) or "
                "model.recompute_granularity none"
            )


def _backward_groups(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The nodes each ``torch.autograd.grad`` call produced, in graph order: the connected
    components of the backward nodes (one per microbatch). Inductor's locality reordering may
    interleave forward nodes with them, so position alone does not separate the microbatches."""
    backward = [node for node in nodes if is_backward(node)]
    parent = {node: node for node in backward}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def is_source(node: fx.Node) -> bool:
        return not any(arg in parent for arg in node.all_input_nodes)

    attached: set[fx.Node] = set()
    for node in backward:
        for arg in node.all_input_nodes:
            if arg not in parent:
                continue
            if is_source(arg):
                # A backward node made from forward values only (a seed, a constant, a transposed
                # weight) may be shared by all microbatches after CSE: it joins its first user only.
                if arg in attached:
                    continue
                attached.add(arg)
            parent[root(arg)] = root(node)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in backward:
        groups.setdefault(root(node), []).append(node)
    return list(groups.values())


def rematerialize(graph: fx.Graph, choose: bool = True) -> None:
    """Recompute every "recompute"-tagged node in each backward group that uses it (in place); the
    forward's all-gathers are tagged first (``regather.tag_forward_gathers``).

    choose: first tag the cheap forward ops whose recomputation shrinks the values kept for the
        backward (``lmfunc.compiler.saved_values``), as AOTAutograd's partitioner would.
    """
    cleanup_recompute_tags(graph.owning_module, is_default_partition=True)
    if any(is_backward(node) for node in graph.nodes):
        regather.tag_forward_gathers(graph, is_backward)
    if choose:
        tag_recompute(graph)
    nodes = list(graph.nodes)
    if not any(must_recompute(node) for node in nodes):
        return
    check_randomness(nodes)
    order = {node: i for i, node in enumerate(nodes)}
    for group in _backward_groups(nodes):
        copies: dict[fx.Node, fx.Node] = {}

        def needed(node: fx.Node) -> list[fx.Node]:
            found: set[fx.Node] = set()
            stack = list(node.all_input_nodes)
            while stack:
                dep = stack.pop()
                if dep in found or dep in copies or not must_recompute(dep):
                    continue
                found.add(dep)
                stack.extend(dep.all_input_nodes)
            return sorted(found, key=order.__getitem__)

        for node in group:
            for dep in needed(node):
                with graph.inserting_before(node):
                    copy = graph.node_copy(dep, lambda arg: copies.get(arg, arg))
                copy.meta["autograd_backward"] = True
                copy.meta.pop("recompute", None)
                copies[dep] = copy
            for arg in node.all_input_nodes:
                if arg in copies:
                    node.replace_input_with(arg, copies[arg])
    graph.eliminate_dead_code()


class RematPass(CustomGraphPass):
    """``rematerialize`` as an Inductor ``post_grad_custom_pre_pass``. Its ``uuid`` is in the key
    of Inductor's and AOTAutograd's caches: it hashes the sources of everything lmfunc changes in
    a compile (this pass, the saved-value choice, the regather tags, the in-place reuse patch and
    the C++ compiler flags), so a cached step compiled under other versions of them is not reused."""

    def __init__(self, choose: bool = True):
        self.choose = choose

    def __call__(self, graph: fx.Graph) -> None:
        rematerialize(graph, self.choose)

    def uuid(self) -> bytes:
        sources = (__file__, saved_values.__file__, regather.__file__, collective_buckets.__file__,
                   inplace_reuse.__file__, cpp_flags.__file__)
        return get_hash_for_files(sources) + bytes([self.choose])

