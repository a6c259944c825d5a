"""All-gathers made again in the backward: the forward keeps the shards, not the gathered values.

Both kinds of compiled function keep every collective's result for the backward unless told
otherwise. A compiled pipeline stage is one forward graph and one backward graph, split from the
joint graph by AOTAutograd's partitioner, which saves every collective's result unless the
collective is tagged for recompute (torch 2.13's ``force_save_collectives``). The one compiled
train step (forward, ``autograd.grad`` and update in one graph) has no partitioner:
``lmfunc.compiler.saved_values`` never recomputes a collective, so every forward value the backward
reads stays alive. Three all-gathers of the forward have results the backward reads again:
- on a ``dp_shard`` mesh, each parameter's FSDP gather (the input gradient's matmul reads the
  whole parameter);
- with sequence parallelism, each layer's input gathered over ``tp`` to the whole sequence (the
  weight gradient's matmul reads it);
- with context parallelism, each layer's keys and values gathered over ``cp`` (the attention
  backward reads them).
Saved, each microbatch in flight keeps its stage's gathered parameters and its layers' gathered
inputs until its backward: under 1F1B the first pipeline rank holds ``pp`` microbatches, so ``pp``
such copies. FSDP (torch's ``reshard_after_forward``, Megatron's) and Megatron's sequence-parallel
linear layers keep the shards instead and gather again in the backward.

``tag_forward_gathers`` tags each all-gather of the forward and its wait with
``CheckpointPolicy.MUST_RECOMPUTE`` (with a parameter's gather also the casts and views between
the parameter and the gather), so the backward gathers the shards again and only the shards are
kept. In a stage, that alone still saved what comes after a gather: a leaf split over two mesh
dims (DeepSeek-V3's dense leaves over ``ep`` and ``dp_shard``) is put together by a concatenation
after its waits, and a parameter cast to the compute dtype after its gather, or without FSDP at
all, is a whole bf16 copy of the weight; each was kept once per microbatch in flight.
``tag_input_copies`` tags every forward value made from the graph's inputs alone by such cheap
ops, so the backward makes it again from the inputs, which stay alive anyway: the parameters are
the train state, and a stage's received activations are held by the schedule for the input
gradient.
``RegatherPass`` runs both as an Inductor ``joint_custom_post_pass`` on a stage's joint graph,
before the partitioner; ``lmfunc.compiler.recompute_pass`` runs ``tag_forward_gathers`` on the one
step's graph, before it chooses what else to recompute (``lmfunc.compiler.saved_values``), and
copies the tagged nodes into each microbatch's backward. A gather copies the same
shards both times, so the values are the same. It costs one more all-gather per microbatch of
each gathered value the backward reads, as FSDP's and Megatron's do, which the backward can
overlap with its compute.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx
from lmfunc.compiler.torch_compat.inductor import CustomGraphPass, get_hash_for_files
from lmfunc.compiler.torch_compat.inductor import is_all_gather_into_tensor, is_wait_tensor
from torch.utils.checkpoint import CheckpointPolicy

from lmfunc.compiler import collective_buckets, saved_values
from lmfunc.compiler.collective_buckets import gathered_placeholder
from lmfunc.compiler.saved_values import recomputable

TANGENT_PREFIX = "tangents"
"""The names of a joint graph's placeholders that hold the outputs' gradients."""


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's nodes that depend on an output's gradient (its backward)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith(TANGENT_PREFIX)) or \
                any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def _gather_chain(all_gather: fx.Node) -> list[fx.Node]:
    """The all-gather and its waits, after the single-input ops (casts, views) between a parameter
    and its gather when it gathers a parameter."""
    chain = []
    if gathered_placeholder(all_gather) is not None:
        x = all_gather.args[0]
        while isinstance(x, fx.Node) and x.op == "call_function":
            chain.append(x)
            x = x.all_input_nodes[0]
    return [*chain, all_gather, *(user for user in all_gather.users if is_wait_tensor(user))]


def tag_forward_gathers(graph: fx.Graph, in_backward: Optional[Callable[[fx.Node], bool]] = None) -> int:
    """Tag every all-gather of ``graph``'s forward (with its wait, and for a parameter what leads
    to it) ``MUST_RECOMPUTE``; returns how many all-gathers were tagged.

    in_backward: whether a node belongs to the backward; by default a joint graph's, the nodes that
        depend on an output's gradient."""
    if in_backward is None:
        in_backward = _backward_nodes(graph).__contains__
    count = 0
    for node in list(graph.nodes):
        if is_all_gather_into_tensor(node) and not in_backward(node):
            for link in _gather_chain(node):
                link.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            count += 1
    return count


def tag_input_copies(graph: fx.Graph, backward: Optional[set[fx.Node]] = None) -> int:
    """Tag ``MUST_RECOMPUTE`` every forward node of the joint ``graph`` whose value is made from the
    graph's floating-point inputs (not the outputs' gradients) alone by cheap ops
    (``saved_values.recomputable``: casts, views, copies, concatenations, pointwise ops) or by the
    gathers ``tag_forward_gathers`` tagged; returns how many were tagged. Values made from the
    integer inputs (tokens, labels, positions) are small and left to the partitioner: tagged, the
    MTP depth's shifted tokens made it recompute that layer's whole forward in the backward.

    backward: the joint graph's backward nodes (``_backward_nodes``), when already found."""
    if backward is None:
        backward = _backward_nodes(graph)
    derived: set[fx.Node] = set()
    count = 0
    for node in graph.nodes:
        if node in backward:
            continue
        if node.op == "placeholder":
            if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].is_floating_point():
                derived.add(node)
        elif node.op == "call_function" and node.all_input_nodes and \
                all(arg in derived for arg in node.all_input_nodes) and \
                (recomputable(node) or node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE):
            derived.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            count += 1
    return count


class RegatherPass(CustomGraphPass):
    """``tag_forward_gathers`` and ``tag_input_copies`` as an Inductor ``joint_custom_post_pass``
    (it runs on the joint graph before AOTAutograd's partitioner). Its ``uuid`` hashes this module
    and the modules whose tests it reads, so compile caches made under another version are not
    reused."""

    def __call__(self, graph: fx.Graph) -> None:
        backward = _backward_nodes(graph)
        tag_forward_gathers(graph, backward.__contains__)
        tag_input_copies(graph, backward)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, collective_buckets.__file__, saved_values.__file__))


def stage_inductor_options() -> dict[str, object]:
    """The Inductor options a compiled pipeline stage is compiled with: its forward's all-gathers
    made again in its backward (``RegatherPass``)."""
    return {"joint_custom_post_pass": RegatherPass()}
