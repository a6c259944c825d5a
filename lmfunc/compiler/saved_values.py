"""Which forward values the one compiled train step keeps for its backward passes.

AOTAutograd's partitioner decides this for ``loss.backward()`` graphs: it stores the smallest set
of tensors from which the backward can be computed, recomputing cheap pointwise ops (a SwiGLU
product, a normalised activation, a log-softmax) instead of storing their results. lmfunc's step
traces ``autograd.grad`` into one graph, so that partitioner never runs and Inductor keeps every
forward buffer a backward op reads. ``choose_recompute`` solves the same problem on the one
graph: a minimum s-t cut in which storing a forward value costs its bytes, values the step holds
anyway (its inputs: params, batch, state) cost nothing, and expensive or random ops (matmuls,
attention, reductions, collectives, RNG draws) may not be recomputed, except what is tagged
``MUST_RECOMPUTE`` before (the forward's all-gathers: ``lmfunc.compiler.regather``). The forward ops
on the backward side of the cut are the ones to recompute; ``lmfunc.compiler.recompute_pass`` copies them into each
backward pass.
"""

from __future__ import annotations

import operator
import warnings

import networkx as nx
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from lmfunc.compiler.torch_compat.inductor import inductor_config
from lmfunc.compiler.torch_compat.tensors import OpOverload
from lmfunc.compiler.torch_compat.tracing import must_recompute, optimization_hint

aten, prims = torch.ops.aten, torch.ops.prims

# Not pointwise or views, but cheap to recompute: constants, index ranges, copies and casts.
_CHEAP_OPS = {
    prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step,
    aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
    aten._to_copy.default, aten.alias.default, aten.cat.default,
}


def is_backward(node: fx.Node) -> bool:
    """Whether ``node`` was traced from a ``torch.autograd.grad`` call."""
    return bool(node.meta.get("autograd_backward", False))


def recomputable(node: fx.Node) -> bool:
    """Whether a forward node may be recomputed in a backward pass: cheap, deterministic and free
    of side effects (pointwise ops, views and the ops in ``_CHEAP_OPS``; never matmuls, attention,
    reductions, gathers, collectives or RNG draws)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
        return False
    return torch.Tag.pointwise in target.tags or target.is_view or target in _CHEAP_OPS


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, OpOverload) and node.target.is_view


def size_estimate(size: int | torch.SymInt) -> int:
    """``size`` as an int: a size known only at run time (an unbacked size) at Inductor's estimate,
    each unknown at ``unbacked_symint_fallback``, without adding a guard."""
    return optimization_hint(size, fallback=inductor_config.unbacked_symint_fallback)


def _bytes(node: fx.Node) -> int | None:
    """Bytes of the node's value: 0 for a host scalar (an ``int``/``float``/``bool`` or its symbolic
    form, such as the split sizes that expert parallelism's all-to-all reads back from a tensor and
    its backward reuses: free to keep, and never recomputable), None when it is neither a single
    tensor nor a scalar (cannot be stored). A size known only at run time (an unbacked size, such as
    the rows an expert-parallel rank receives) is estimated with Inductor's
    ``unbacked_symint_fallback`` for each unknown, without adding a guard."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return size_estimate(value.numel()) * value.element_size()
    if isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return 0
    return None


def forward_nodes_for_backward(nodes: list[fx.Node]) -> list[fx.Node]:
    """The forward (non-backward) nodes that some backward node depends on, in graph order."""
    needed: set[fx.Node] = set()
    stack = [arg for node in nodes if is_backward(node) for arg in node.all_input_nodes if not is_backward(arg)]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        stack.extend(arg for arg in node.all_input_nodes if not is_backward(arg))
    return [node for node in nodes if node in needed]


def choose_recompute(graph: fx.Graph) -> set[fx.Node]:
    """The forward nodes to recompute in the backward passes so that the values kept from the
    forward to the backward take the fewest bytes (a minimum cut; see the module docstring).

    Nodes tagged "recompute" (``lmfunc.model.recompute.checkpointed``) are always recomputed;
    nodes tagged ``MUST_SAVE`` are kept. Returns an empty set for a graph without backward nodes.
    """
    nodes = list(graph.nodes)
    forward = forward_nodes_for_backward(nodes)
    if not forward:
        return set()
    forward_set = set(forward)
    flow = nx.DiGraph()
    for node in forward:
        node_in, node_out = (node.name, "in"), (node.name, "out")
        always_held = node.op in ("placeholder", "get_attr")
        size = 0 if always_held else _bytes(node)
        if size is None or (_is_view(node) and not always_held):
            flow.add_edge(node_in, node_out)  # cannot be stored: keep its base or inputs instead
        else:
            flow.add_edge(node_in, node_out, capacity=size)
        if must_recompute(node):
            flow.add_edge(node_in, "sink")
        elif always_held or not recomputable(node) or node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE:
            flow.add_edge("source", node_in)
        for user in node.users:
            if user in forward_set:
                flow.add_edge(node_out, (user.name, "in"))
            elif is_backward(user):
                flow.add_edge(node_out, "sink")
    try:
        _, (source_side, _) = nx.minimum_cut(flow, "source", "sink")
    except nx.NetworkXUnbounded:  # a value that can be neither stored nor recomputed: keep the graph
        stuck = [node.name for node in forward if _bytes(node) is None and not recomputable(node)
                 and any(is_backward(user) for user in node.users)]
        warnings.warn(f"lmfunc.compiler.saved_values: the backward reads forward values that can be neither "
                      f"stored nor recomputed ({', '.join(stuck) or 'through views'}); the step keeps every "
                      "forward value its backward reads, which takes more memory than the plan predicts")
        return {node for node in forward if must_recompute(node)}
    return {node for node in forward if (node.name, "in") not in source_side}


def tag_recompute(graph: fx.Graph) -> int:
    """Tag the nodes ``choose_recompute`` picks with ``PREFER_RECOMPUTE`` (user tags are kept);
    returns how many nodes were newly tagged."""
    count = 0
    for node in choose_recompute(graph):
        if not must_recompute(node):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            count += 1
    return count
