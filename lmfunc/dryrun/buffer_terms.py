"""Which of the plan's terms each buffer live at a one-graph step's peak belongs to.

The trainer's step is one graph: ``torch.autograd.grad`` is traced inline (``lmfunc.grad``), so the
forward, the backward and the update are nodes of one post-grad graph, and torch.fx marks the nodes
traced from the backward (``autograd_backward`` in their meta; a ``control_deps`` node of
Inductor's ordering passes copies the meta of the op it wraps; a loop a pass made from a scan does
not, and is counted in the backward when it reads a value of the backward). Each buffer
Inductor's scheduler holds at the peak is put in one of ``lmfunc.plan``'s terms
(``MemoryPlan.terms``) by the value it holds, the value of the graph node that makes it
(``ValueTerms.defining_node``):

- **gradients**: a parameter's gradient from the backward op that makes it until the update reads
  it: a value of the backward that reaches a node outside it (the accumulation over microbatches,
  the clipping, the update) only through ops that move or sum gradients (copies, casts,
  concatenations into a bucket, reduce-scatters and all-reduces, additions, a scaling by a scalar:
  ``_moves_gradients``), and what those ops make of gradients outside the backward (the sum over
  microbatches, the clipped gradients; Inductor's ``addmm`` of a gradient and the next
  microbatch's weight-gradient matmul). A matmul or a reduction over the tokens is not such an op,
  so the activation gradient a weight-gradient matmul (or a norm weight's sum) reads is the
  backward's working set.
- **kept activations**: a value of the forward, made from the batch (its integer tensors, the
  tokens, labels and positions), that a kernel of the backward reads, as the scheduler fused it:
  Inductor inlines pointwise ops into their readers, so the buffer a backward kernel reads may be
  the matmul before a residual add that the forward never stores.
- **working set**: every other buffer: the backward's activation gradients, the gathered and cast
  parameters (compute copies: made from the state alone), the output layer's logits, the update's
  temporaries.

A buffer counts what freeing it returns (a multi-output kernel's outputs are each counted, by the
values they hold, and the kernel's allocation of them all is not); the terms add up to
``ScheduledMemory.peak``, the working set taking any difference."""

from __future__ import annotations

import operator
from collections import Counter
from typing import Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from lmfunc.compiler.torch_compat.tensors import HigherOrderOperator, OpOverload
from lmfunc.plan.memory import GRADIENTS_TERM, KEPT_TERM, WORKING_TERM

aten = torch.ops.aten

_GRADIENT_MOVES = {
    aten.cat.default, aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.clone.default,
    aten.copy.default, aten.copy_.default, aten.add.Tensor, aten.add_.Tensor, aten._foreach_add.List,
    aten._foreach_add_.List, aten.slice_scatter.default,
}
"""Ops that move, cast, concatenate or sum gradients (``_moves_gradients``)."""
_SCALINGS = {
    aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.mul_.Tensor, aten.div_.Tensor,
    aten._foreach_mul.Tensor, aten._foreach_mul.Scalar, aten._foreach_div.Tensor, aten._foreach_div.Scalar,
}
"""Ops that scale gradients when every other operand is a scalar (a mean over ranks, the clipping's
factor, the loss scale's inverse)."""


def _control_deps():
    from lmfunc.compiler.torch_compat.inductor import control_deps

    return control_deps


def _target(node: fx.Node, control_deps) -> object:
    """The op ``node`` runs: for Inductor's ``control_deps(deps, subgraph, *args)``, the one op of its
    subgraph."""
    if node.op != "call_function":
        return None
    if node.target is not control_deps:
        return node.target
    subgraph = node.args[1]
    module = getattr(node.graph.owning_module, subgraph.target, None) if isinstance(subgraph, fx.Node) else None
    calls = [n for n in module.graph.nodes if n.op == "call_function"] if isinstance(module, fx.GraphModule) else []
    return calls[0].target if len(calls) == 1 else node.target


def _is_alias(target: object) -> bool:
    """Whether an op's result is (a view of) its first input's storage: views and the wait of a
    functional collective (not ``getitem``: each output of a multi-output op is a tensor of its own)."""
    if isinstance(target, OpOverload):
        return (target.is_view or target is aten._unsafe_view.default
                or (target.namespace == "_c10d_functional" and target._opname == "wait_tensor"))
    return False


def _is_tensor(node: fx.Node, more_than_one: bool = False) -> bool:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return False
    return not more_than_one or not statically_known_true(value.numel() == 1)


class ValueTerms:
    """The graph's nodes whose values are gradients and those made from the batch (module docstring)."""

    def __init__(self, graph: fx.Graph):
        control_deps = _control_deps()
        self.nodes = list(graph.nodes)
        self.order = {node: i for i, node in enumerate(self.nodes)}
        self.targets = {node: _target(node, control_deps) for node in self.nodes}
        self.inputs: dict[fx.Node, list[fx.Node]] = {}
        for node in self.nodes:
            if node.op == "call_function" and node.target is control_deps:  # its ordering deps are not read
                found: list[fx.Node] = []
                fx.node.map_arg((node.args[2:], node.kwargs), found.append)
                self.inputs[node] = found
            else:
                self.inputs[node] = node.all_input_nodes
        self.users: dict[fx.Node, list[fx.Node]] = {node: [] for node in self.nodes}
        for node in self.nodes:
            for arg in self.inputs[node]:
                self.users[arg].append(node)
        self.backward = self._backward()
        self.from_batch = self._from_batch()
        self.gradients = self._gradients()

    def alias(self, node: fx.Node) -> bool:
        return _is_alias(self.targets[node])

    def base(self, node: fx.Node) -> fx.Node:
        """The node whose storage ``node``'s value is."""
        while self.alias(node) and self.inputs[node]:
            node = self.inputs[node][0]
        return node

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """The nodes that read ``node``'s value, through its aliases."""
        found, stack = [], list(self.users[node])
        while stack:
            user = stack.pop()
            if self.alias(user):
                stack.extend(self.users[user])
            else:
                found.append(user)
        return found

    def _backward(self) -> set[fx.Node]:
        """The nodes traced from the backward: those marked so, a loop (a higher-order op, such as
        the ``while_loop`` Inductor lowers a scan to, which does not keep the mark) that reads a
        value of the backward, and the outputs of either."""
        backward: set[fx.Node] = set()
        for node in self.nodes:
            target = self.targets[node]
            reads_backward = any(self.base(arg) in backward for arg in self.inputs[node])
            if (node.meta.get("autograd_backward", False)
                    or (isinstance(target, HigherOrderOperator) and reads_backward)
                    or (target is operator.getitem and reads_backward)):
                backward.add(node)
        return backward

    def runs_backward(self, scheduler_node) -> bool:
        """Whether a (fused) scheduler node runs an op of the backward."""
        return any(origin in self.backward
                   for sub in scheduler_node.get_nodes() if sub.node is not None for origin in sub.node.origins)

    def _from_batch(self) -> set[fx.Node]:
        made = set()
        for node in self.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder":
                if (isinstance(value, torch.Tensor) and value.ndim >= 1 and not value.is_floating_point()
                        and value.dtype != torch.bool):
                    made.add(node)
            elif any(arg in made for arg in self.inputs[node]):
                made.add(node)
        return made

    def _moves_gradients(self, node: fx.Node) -> bool:
        target = self.targets[node]
        if isinstance(target, OpOverload) and target.namespace == "_c10d_functional":
            return target._opname.startswith(("reduce_scatter", "all_reduce"))
        if target in _GRADIENT_MOVES:
            return True
        return target in _SCALINGS and sum(_is_tensor(arg, more_than_one=True) for arg in self.inputs[node]) == 1

    def _gradients(self) -> set[fx.Node]:
        backward = self.backward
        gradients: set[fx.Node] = set()
        for node in reversed(self.nodes):  # readers first
            if node in backward and node.op == "call_function" and not self.alias(node):
                readers = self.readers(node)
                if readers and all((reader not in backward and reader.op != "output")
                                   or (reader in gradients and self._moves_gradients(reader)) for reader in readers):
                    gradients.add(node)
        for node in self.nodes:
            if node in backward or node.op != "call_function" or self.alias(node):
                continue
            if self.targets[node] in (aten.addmm.default, operator.getitem):
                # Inductor's sum of a gradient and a matmul; one of the gradients a foreach op makes
                if self.base(self.inputs[node][0]) in gradients:
                    gradients.add(node)
            elif self._moves_gradients(node):
                operands = [arg for arg in self.inputs[node] if _is_tensor(arg, more_than_one=True)]
                if operands and all(self.base(arg) in gradients for arg in operands):
                    gradients.add(node)
        return gradients

    def defining_node(self, buffer) -> Optional[fx.Node]:
        """The graph node whose value an Inductor IR buffer holds: its ``origin_node`` where Inductor
        recorded one, else the last of its origins (the ops fused into it) in graph order."""
        origin = buffer.get_origin_node() if hasattr(buffer, "get_origin_node") else None
        if origin is not None and origin in self.order:
            return self.base(origin)
        origins = [node for node in getattr(buffer, "origins", None) or () if node in self.order]
        return self.base(max(origins, key=self.order.__getitem__)) if origins else None


def split_peak(graph: fx.Graph, infos: list, at: int, peak: int) -> tuple[tuple[str, int], ...]:
    """The ``peak`` bytes of scheduled buffers at step ``at`` of the schedule (``torch._inductor.memory``'s
    ``BufferInfo``s of ``graph``'s lowering), split into gradients, kept activations and working set
    (module docstring)."""
    values = ValueTerms(graph)
    terms = Counter({GRADIENTS_TERM: 0, KEPT_TERM: 0, WORKING_TERM: 0})
    for info in infos:
        if info.start_step > at or (info.end_step != -1 and info.end_step < at) or not info.size_free:
            continue
        node = getattr(info.buffer, "node", None)
        made_by = values.defining_node(node) if node is not None else None
        if made_by in values.gradients:
            terms[GRADIENTS_TERM] += info.size_free
        elif (made_by in values.from_batch and made_by not in values.backward
              and any(values.runs_backward(reader) for reader in info.buffer.mpi_buffer.succ_nodes)):
            terms[KEPT_TERM] += info.size_free
        else:
            terms[WORKING_TERM] += info.size_free
    terms[WORKING_TERM] += peak - sum(terms.values())
    return tuple(terms.items())
