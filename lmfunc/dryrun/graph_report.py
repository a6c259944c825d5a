"""What one rank's captured step graph does, read from the graph alone: its collectives (kind, mesh
dims, count, bytes sent), its FLOPs and its peak memory.

- Collectives: every functional collective node (``torch.ops._c10d_functional``), by kind (an
  ``_out`` or in-place variant counts as its collective) and by the mesh dims of its process group;
  the bytes are the first input's, what this rank hands the collective (as the comm report of a
  real run counts them). A size known only at run time (expert parallelism's token exchange) is
  counted as a collective with unknown bytes.
- FLOPs: torch's FLOP formulas (``torch.utils.flop_counter``: matmuls, attention, convolutions)
  applied to each node's shapes; a ``scan``'s body counts once per iteration, and so does the body
  of the ``while_loop`` Inductor lowers a scan to (its condition ``counter < n`` gives ``n``).
- Memory: the inputs (parameters, optimizer state, batch), live throughout, plus the peak of the
  buffers Inductor's scheduler allocates, in its order, after fusion (``capture.ScheduledMemory``,
  Inductor's own estimate, ``torch._inductor.memory``): a fused kernel's temporaries never exist.
  The buffers at the peak are split into gradients, kept activations and working set by the values
  they hold (``lmfunc.dryrun.buffer_terms``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Iterator, Optional

import torch
from torch import fx

from lmfunc.compiler.torch_compat.tensors import OpOverload, pytree
from lmfunc.dryrun.capture import CapturedStep, estimated
from lmfunc.plan.memory import STATE_TERM


@dataclasses.dataclass(frozen=True)
class CollectiveUse:
    kind: str
    dims: str
    count: int
    elements: Optional[int]
    """Elements this rank hands the collectives in one step; None when a size is known only at run time."""
    bytes: Optional[int]


def _subgraphs(node: fx.Node, module: fx.GraphModule) -> list[tuple[fx.GraphModule, int]]:
    """The graphs a higher-order op node runs, with how many times each runs per call (a scan's
    length; 1 for other operators)."""
    found = []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(module, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                found.append(sub)
    if not found:
        return []
    times = 1
    if node.target is torch.ops.higher_order.while_loop and len(found) == 2:
        return [(found[1], _trip_count(found[0]) or 1)]  # (cond, body): the body runs once per iteration
    if node.target is torch.ops.higher_order.scan:
        xs = node.args[2]
        first = xs[0] if isinstance(xs, (list, tuple)) and xs else None
        if isinstance(first, fx.Node) and isinstance(first.meta.get("val"), torch.Tensor):
            times = _concrete(first.meta["val"].shape[0]) or 1
    return [(sub, times) for sub in found]


def _trip_count(cond: fx.GraphModule) -> Optional[int]:
    """The iterations of a ``while_loop`` whose condition is ``counter < n`` on its first carried
    value (what Inductor lowers a ``scan`` to: a counter from 0), else None."""
    first = next((n for n in cond.graph.nodes if n.op == "placeholder"), None)
    output = next(n for n in cond.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (list, tuple)) else result
    if (isinstance(result, fx.Node) and result.target is torch.ops.aten.lt.Scalar and result.args[0] is first
            and isinstance(result.args[1], int)):
        return result.args[1]
    return None


def walk(module: fx.GraphModule, times: int = 1) -> Iterator[tuple[fx.Node, int]]:
    """Every call node of ``module`` and of the graphs its higher-order ops run, with how many
    times it runs per step."""
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        yield node, times
        for sub, n in _subgraphs(node, module):
            yield from walk(sub, times * n)


def _concrete(value) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _elements(value) -> Optional[int]:
    return _concrete(value.numel()) if isinstance(value, torch.Tensor) else 0


def _tensor_bytes(value) -> Optional[int]:
    if not isinstance(value, torch.Tensor):
        return 0
    numel = _concrete(value.numel())
    return None if numel is None else numel * value.element_size()


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    return (isinstance(target, OpOverload) and target.namespace == "_c10d_functional"
            and not target._opname.startswith("wait"))


def collective_kind(target: OpOverload) -> str:
    """``all_reduce`` for ``all_reduce``, ``all_reduce_`` and ``..._out``."""
    return target._opname.removesuffix("_out").rstrip("_")


def _argument(node: fx.Node, name: str):
    target, args, kwargs = _call(node)
    for index, argument in enumerate(target._schema.arguments):
        if argument.name == name:
            return args[index] if index < len(args) else kwargs.get(name)
    return None


def _call(node: fx.Node) -> tuple:
    """(operator, args, kwargs) that ``node`` runs: for AOTAutograd's RNG wrappers of a recomputed
    random op (``run_and_save_rng_state(op, *args)``, ``run_with_rng_state(state, op, *args)``),
    the wrapped op and its arguments."""
    target, args = node.target, node.args
    if target is torch.ops.higher_order.run_and_save_rng_state:
        return args[0], args[1:], node.kwargs
    if target is torch.ops.higher_order.run_with_rng_state:
        return args[1], args[2:], node.kwargs
    return target, args, node.kwargs


def collectives(step: CapturedStep) -> list[CollectiveUse]:
    """The step's collectives on this rank, grouped by (kind, mesh dims)."""
    counts: Counter = Counter()
    sent: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0])
    for node, times in walk(step.graph):
        if not _is_collective(node):
            continue
        group = _argument(node, "group_name")
        key = (collective_kind(node.target), step.group_dims.get(group, str(group)))
        counts[key] += times
        first = node.args[0]
        values = [v.meta.get("val") for v in (first if isinstance(first, (list, tuple)) else [first])
                  if isinstance(v, fx.Node)]
        for slot, size in enumerate((_elements, _tensor_bytes)):
            amounts = [size(v) for v in values]
            total = sent[key][slot]
            sent[key][slot] = None if total is None or None in amounts else total + times * sum(amounts)
    return [CollectiveUse(kind, dims, n, *sent[(kind, dims)]) for (kind, dims), n in sorted(counts.items())]


def differences_from_measured(uses: list[CollectiveUse], counts: dict[str, int],
                              elements: dict[str, int]) -> list[str]:
    """How the dry run's collectives ``uses`` differ from those a run measured on the same rank
    (kind -> ``counts`` and ``elements`` handed over, every mesh dim together, as the comm report
    counts them: ``experiments.bench.comm.step_collectives``); [] when they are equal: every kind's
    count, and its elements where the dry run knows them (not the experts' token exchange, whose
    sizes are known only at run time)."""
    traced_counts: Counter = Counter()
    traced_elements: dict[str, Optional[int]] = {}
    for use in uses:
        traced_counts[use.kind] += use.count
        known = traced_elements.get(use.kind, 0)
        traced_elements[use.kind] = None if known is None or use.elements is None else known + use.elements
    differences = []
    for kind in sorted(set(traced_counts) | {kind for kind, count in counts.items() if count}):
        if traced_counts[kind] != counts.get(kind, 0):
            differences.append(f"{kind}: {traced_counts[kind]} traced, {counts.get(kind, 0)} measured")
        elif traced_elements.get(kind) is not None and traced_elements[kind] != elements.get(kind, 0):
            differences.append(f"{kind}: {traced_elements[kind]} elements traced, {elements.get(kind, 0)} measured")
    return differences


def _vals(args):
    return pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, args)


def _attention_flops(node: fx.Node) -> Optional[object]:
    """FLOPs of a fused attention op (any ``scaled_dot_product``/``flash``/``efficient`` attention,
    forward or backward; None for other ops), counted as Megatron counts them: the scores and the
    weighted values, ``2 B H Sq Sk (Dqk + Dv)`` in the forward and twice that in the backward, half
    of it with a causal mask (the scores above the diagonal are never needed)."""
    target, _, _ = _call(node)
    name = getattr(target, "_opname", "")
    if not ("scaled_dot_product" in name or name.startswith(("_flash_attention", "_efficient_attention"))):
        return None
    query, key, value, causal = (_argument(node, field) for field in ("query", "key", "value", "is_causal"))
    if not all(isinstance(x, fx.Node) for x in (query, key, value)):
        return None
    q, k, v = (x.meta["val"].shape for x in (query, key, value))
    batch_heads = q[0] * q[1]  # [B, H, S, D]
    forward = 2 * batch_heads * q[2] * k[2] * (q[3] + v[3])
    return forward * (2 if "backward" in name else 1) / (2 if causal else 1)


def _grouped_mm_flops(node: fx.Node) -> Optional[object]:
    """FLOPs of lmfunc's expert matmuls (``lmfunc.model.moe``; None for other ops):
    ``grouped_mm(rows [T, K], weights [E, K, N])`` and ``grouped_mm_weight_grad(rows [T, K],
    grad [T, N])`` each multiply every row once: ``2 T K N``. ``T``, the rows routed to this rank's
    experts, is known only at run time under expert parallelism (a symbol, which ``flops``
    estimates)."""
    name = node.target.name() if isinstance(node.target, OpOverload) else ""
    if name not in ("lmfunc::grouped_mm", "lmfunc::grouped_mm_weight_grad"):
        return None
    rows, other = (node.args[0].meta["val"].shape, node.args[1].meta["val"].shape)
    width = other[-1] if name == "lmfunc::grouped_mm" else other[1]
    return 2 * rows[0] * rows[1] * width


def flops(step: CapturedStep) -> tuple[int, int]:
    """(FLOPs of one step on this rank, number of ops whose FLOPs depend on sizes known only at run
    time, counted at their estimate: ``capture.estimated``, an even share of the experts' tokens in
    a dry run). Matmuls and convolutions by torch's formulas
    (``torch.utils.flop_counter``), fused attention by ``_attention_flops``, the experts' grouped
    matmuls by ``_grouped_mm_flops``."""
    from torch.utils.flop_counter import flop_registry

    total, sized = 0, 0
    for node, times in walk(step.graph):
        target, args, kwargs = _call(node)
        packet = getattr(target, "overloadpacket", None)
        count = _attention_flops(node)
        if count is None:
            count = _grouped_mm_flops(node)
        if count is None and packet in flop_registry:
            out = node.meta.get("val")
            if target is not node.target and isinstance(out, (tuple, list)):
                out = out[-1]  # run_and_save_rng_state's (state, output)
            count = flop_registry[packet](*_vals(args), **_vals(kwargs), out_val=out)
        if count is None:
            continue
        value = _concrete(count)
        if value is None:
            value = estimated(count) or 0
            sized += times
        total += times * value
    return total, sized


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    peak: int
    """Bytes live at the step's peak: its inputs plus the buffers Inductor's schedule holds there."""
    inputs: int
    """The graph's inputs: parameters, optimizer state, loss scaler, batch (this rank's shards)."""
    at_node: str
    """Where in Inductor's schedule the peak is reached."""
    largest: list[tuple[str, int]]
    """The largest buffers live at the peak: (name and ops, bytes)."""
    terms: tuple[tuple[str, int], ...] = ()
    """The peak split as ``lmfunc.plan`` splits its own (``MemoryPlan.terms``): (term, bytes), adding
    up to ``peak``."""


def memory(step: CapturedStep) -> MemoryReport:
    """Peak bytes of the compiled step (module docstring)."""
    inputs = sum(_tensor_bytes(value) or 0 for value in step.inputs)
    scheduled = step.scheduled
    peak = inputs + scheduled.peak
    return MemoryReport(peak, inputs, f"scheduled node {scheduled.at_step} of {scheduled.steps}", scheduled.largest,
                        ((STATE_TERM, inputs), *scheduled.terms))


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What a rank's step holds, sends and computes: read off one captured step (``step_facts``)
    or extrapolated from several (``lmfunc.dryrun.extrapolate``)."""

    collectives: list[CollectiveUse]
    flops: int
    flops_estimated_ops: int
    memory: MemoryReport
    dims_ranks: dict[str, list[int]]
    rank: int
    trace_seconds: float
    traced: str
    """How the numbers were obtained (the traced depth and microbatches, and any extrapolation)."""


def step_facts(step: CapturedStep, traced: str = "the whole step traced") -> StepFacts:
    total, sized = flops(step)
    return StepFacts(collectives(step), total, sized, memory(step), step.dims_ranks, step.rank,
                     step.trace_seconds, traced)
