"""The dry run of a pipeline-parallel rank: its train step, run on fake tensors, with every graph the
step compiles captured as Inductor would compile it.

A pipeline rank's step is not one graph: torch's schedule calls each stage's compiled forward and
backward once per microbatch, sends and receives activations and gradients between them, and the
update is a compiled function of its own (``lmfunc.train.pipeline_step``). So the step is run, as
the trainer builds it (``lmfunc.train.pipeline_run.pipeline_steps``), on fake tensors over a fake
process group (``lmfunc.dryrun.world``):

- Each function the step compiles goes through Inductor as in the run (``capture.capturing_backend``:
  AOTAutograd, the post-grad passes, lowering, scheduling), and the graphs Inductor would compile
  are kept; AOTAutograd's graphs then run on the fake tensors in their place, so the schedule goes on.
- ``StepRecorder`` (a dispatch mode) counts the bytes of every tensor the step keeps between those
  graphs (its state, the activations saved for a stage's backward, the accumulated gradients, the
  received activations) and the collectives the eager code issues (the schedule's sends and
  receives, the tied embedding's gradient all-reduce, the token count and metric sums).
- Collectives and FLOPs are each captured graph's (``graph_report``) times its calls, plus the
  eager collectives. The peak is the largest of: what the step keeps when a graph starts, plus
  that graph's scheduled buffers (``capture.ScheduledMemory``: its working set and outputs), over
  every call. A graph's inputs are counted live until it returns (a compiled backward frees its
  saved activations as it goes: an upper bound by at most one microbatch's activations).

torch's schedule starts with a vote between the stages, read with ``.item()``, which the fake
backend never answers: every stage is given its shapes (``pipeline_stages.StageShapes``), so the
vote's outcome is known (every stage static) and is set instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
import weakref
from collections import Counter, defaultdict
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lmfunc.compiler.torch_compat.distributed import pipeline_shapes_without_vote, receive_buffers_made_inside
from lmfunc.compiler.torch_compat.tensors import HigherOrderOperator, TorchDispatchMode, pytree
from lmfunc.compiler.torch_compat.tracing import functorch_config
from lmfunc.config.train import TrainConfig
from lmfunc.dryrun.capture import CapturedStep, batch_plan, capturing_backend, estimated, fake_batch
from lmfunc.dryrun.graph_report import CollectiveUse, MemoryReport, StepFacts, collective_kind, collectives, flops
from lmfunc.dryrun.world import fake_world, group_dims, mesh_of
from lmfunc.parallel.mesh import Layout
from lmfunc.plan.memory import GRADIENTS_TERM, KEPT_TERM, RECEIVE_TERM, STATE_TERM, WORKING_TERM
from lmfunc.precision import compute_dtype
from lmfunc.train.make_optimizer import run_optimizer
from lmfunc.train.pipeline_run import init_rank_params, pipeline_rank, pipeline_steps
from lmfunc.train.run_step import even_expert_share
from lmfunc.train.state import TrainState

EAGER_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "broadcast": "broadcast", "send": "send",
               "recv": "recv", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all"}
"""torch's ``c10d`` ops (what ``torch.distributed``'s eager calls dispatch), by the collective they are."""


GRAPH_OUTPUTS = "outputs of captured graph "
INPUTS = "the step's inputs (state, batch)"
RECEIVE_BUFFERS = "the stages' receive buffers"
"""What made a tensor kept between the graphs (``StepRecorder.by_maker``'s keys): a captured graph
(its index follows), the step's caller, torch's stages allocating their receive buffers
(``StepRecorder.receive_buffers``), or another eager op (``eager`` and its name)."""


def _storage_bytes(tensor: torch.Tensor) -> tuple[Optional[object], int]:
    """(the storage that holds ``tensor``'s data, its bytes); for a DTensor its local shard's."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    storage = tensor.untyped_storage()
    return storage, estimated(storage.nbytes()) or 0  # a size known only at run time: its estimate


class StepRecorder(TorchDispatchMode):
    """While active: the bytes of every tensor made outside the captured graphs and still alive
    (``live``), the collectives issued outside them (``eager``: kind, process group, elements,
    bytes), and every call of a captured graph with the bytes alive when it started (``calls``).
    ``runner`` is the ``capture.GraphRunner`` that runs the captured graphs and records their calls."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, tuple[weakref.ref, int, str]] = {}
        self.total = 0
        self.by_maker: Counter = Counter()
        """The bytes alive by what made them: the step's inputs, a captured graph's outputs, an eager op."""
        self.made_by_graphs = WeakIdKeyDictionary()
        self.kept_outside: Optional[WeakIdKeyDictionary] = None
        self.inside = False
        self.calls: list[tuple[int, int, frozenset, Counter]] = []
        """Per graph call: the graph, the bytes alive when it starts, the inputs it frees, and
        ``by_maker`` then."""
        self.kept_per_call: dict[int, Counter] = {}
        """Captured graph -> the bytes one call's new outputs hold, by the op that made each."""
        self.eager: list[tuple[str, str, int, int]] = []
        self.peak_between_graphs = 0
        self.makers_at_peak: Counter = Counter()
        """``by_maker`` when ``peak_between_graphs`` was reached."""
        self.allocating: Optional[str] = None
        """What the tensors made now are (``receive_buffers``); None: the eager op that makes them."""
        self.graph_kinds: dict[int, str] = {}
        """Captured graph -> ``"forward"``, ``"backward"`` or ``"inference"`` (``capture.GraphRunner``)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while Dynamo and Inductor compile (they would refuse to trace under it), on while the
        compiled functions run."""
        return True

    def hold(self, tree, maker: str = INPUTS) -> None:
        """Count every tensor in ``tree`` as alive until it is freed, as made by ``maker``."""
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self._hold_storage(*_storage_bytes(leaf), maker)

    def _hold_storage(self, storage, size: int, maker: str) -> bool:
        """Count ``storage`` (``size`` bytes, made by ``maker``) as alive until it is freed; whether
        it was new."""
        key = id(storage)
        held = self.sizes.get(key)
        if held is not None:
            if held[0]() is storage:
                return False
            self.total -= held[1]  # a freed storage whose id was reused
            self.by_maker[held[2]] -= held[1]

        def freed(ref, key=key, size=size, maker=maker) -> None:
            if self.sizes.get(key, (None,))[0] is ref:
                del self.sizes[key]
                self.total -= size
                self.by_maker[maker] -= size

        self.sizes[key] = (weakref.ref(storage, freed), size, maker)
        self.total += size
        self.by_maker[maker] += size
        return True

    def live(self) -> int:
        """Bytes of the tensors held and not yet freed."""
        return self.total

    supports_higher_order_operators = True
    """Higher-order operators (the RNG state's ``run_and_save_rng_state`` in a stage's graph) pass
    through, uncounted: they run inside the captured graphs only."""

    @contextlib.contextmanager
    def receive_buffers(self) -> Iterator[None]:
        """While inside, the tensors made are counted as the stages' receive buffers."""
        self.allocating, before = RECEIVE_BUFFERS, self.allocating
        try:
            yield
        finally:
            self.allocating = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside and not isinstance(func, HigherOrderOperator):
            self._record_collective(func, args)
            self.hold(out, self.allocating or f"eager {func.overloadpacket.__name__}")
            if self.live() > self.peak_between_graphs:
                self.peak_between_graphs, self.makers_at_peak = self.live(), +self.by_maker
        return out

    def _record_collective(self, func, args) -> None:
        packet = func.overloadpacket
        namespace, name = packet._qualified_op_name.split("::")
        if namespace == "_c10d_functional" and not name.startswith("wait"):
            kind, group = collective_kind(func), args[-1]
        elif namespace == "c10d" and name.rstrip("_") in EAGER_KINDS:
            kind = EAGER_KINDS[name.rstrip("_")]
            group = dist.ProcessGroup.unbox(args[1]).group_name  # (tensors, process_group, ...)
        else:
            return
        tensors = [t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
        elements = sum(int(t.numel()) for t in tensors)
        self.eager.append((kind, str(group), elements, sum(int(t.numel()) * t.element_size() for t in tensors)))

    def start(self) -> None:
        """From now on the tensors alive (the state, the batch) are the caller's: a graph never
        frees them."""
        self.kept_outside = WeakIdKeyDictionary({ref(): True for ref, _, _ in self.sizes.values() if ref() is not None})

    def _freeable(self, args: list) -> frozenset:
        """The positions of ``args`` a compiled graph frees after their last use: tensors another
        captured graph made (the activations a forward saved for its backward), not the caller's."""
        positions = set()
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                storage, _ = _storage_bytes(arg)
                if storage in self.made_by_graphs and not (self.kept_outside and storage in self.kept_outside):
                    positions.add(position)
        return frozenset(positions)

    def runner(self, index: int, graph: torch.fx.GraphModule, kind: str):
        makers = _output_makers(graph)
        self.graph_kinds[index] = kind

        def run(args: list):
            self.calls.append((index, self.live(), self._freeable(args), +self.by_maker))
            self.inside = True
            try:
                outputs = graph(*args)
            finally:
                self.inside = False
            kept: Counter = Counter()
            for maker, leaf in zip(makers, outputs):
                if isinstance(leaf, torch.Tensor):
                    storage, size = _storage_bytes(leaf)
                    if self._hold_storage(storage, size, f"{GRAPH_OUTPUTS}{index}"):
                        kept[maker] += size
                    self.made_by_graphs[storage] = True
            self.kept_per_call.setdefault(index, kept)
            return outputs

        run._boxed_call = True
        return run


def plan_terms(makers: Counter, graph_kinds: dict[int, str], working: int) -> tuple[tuple[str, int], ...]:
    """The bytes kept between the graphs, by what made them (``makers``), and a graph's own buffers
    (``working``), split as ``lmfunc.plan`` splits a pipeline rank's peak: the state and batch, the
    gradients (kept outputs of the backward graphs), the kept activations (of the forward graphs),
    the receive buffers and the working set; the update's outputs (the new state) count as state,
    anything else eager (metrics, token counts) as working set."""
    terms = Counter({STATE_TERM: 0, GRADIENTS_TERM: 0, KEPT_TERM: 0, RECEIVE_TERM: 0, WORKING_TERM: working})
    for maker, size in makers.items():
        if maker == INPUTS:
            terms[STATE_TERM] += size
        elif maker.startswith(GRAPH_OUTPUTS):
            kind = graph_kinds.get(int(maker.removeprefix(GRAPH_OUTPUTS)))
            terms[GRADIENTS_TERM if kind == "backward" else KEPT_TERM if kind == "forward" else STATE_TERM] += size
        elif maker == RECEIVE_BUFFERS:
            terms[RECEIVE_TERM] += size
        else:
            terms[WORKING_TERM] += size
    return tuple(terms.items())


def _output_makers(graph: torch.fx.GraphModule) -> list[str]:
    """For each output of ``graph``, the op that made it, through views, tuple items and a
    collective's wait (``input`` for a view of an input)."""
    output = next(iter(graph.graph.find_nodes(op="output")))
    makers = []
    for node in pytree.tree_leaves(output.args[0]):
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
                getattr(node.target, "_opname", "") == "wait_tensor" or getattr(node.target, "is_view", False)
                or node.target is operator.getitem):
            node = node.args[0]
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            makers.append("input")
        else:
            makers.append(getattr(node.target, "_opname", None) or getattr(node.target, "__name__", str(node.target)))
    return makers


@contextlib.contextmanager
def _dry_run_settings(recorder: StepRecorder) -> Iterator[None]:
    """The stages' given shapes taken without torch's start-up vote (``pipeline_shapes_without_vote``),
    no compile cache, and the stages' receive buffers counted as such (made inside
    ``recorder.receive_buffers()``)."""
    with pipeline_shapes_without_vote(), receive_buffers_made_inside(recorder.receive_buffers), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


def pipeline_roles(sizes: dict[str, int], world_size: int) -> list[tuple[str, int, int]]:
    """The distinct roles of a pipeline of ``sizes["pp"]`` ranks: (name, pipeline rank, global rank)
    of the first pipeline rank, the second (the middle rank with the most microbatches in flight,
    when the pipeline has more than two) and the last, each at the first coordinate of the other
    dims (``pp`` is the mesh's outermost dim)."""
    pp = sizes["pp"]
    roles = [("first pipeline rank", 0)]
    if pp > 2:
        roles.append(("middle pipeline rank", 1))
    roles.append(("last pipeline rank", pp - 1))
    return [(name, index, index * (world_size // pp)) for name, index in roles]


def trace_pipeline_rank(cfg: TrainConfig, world_size: int, rank: int, expert_load: float = 1.0) -> StepFacts:
    """The step facts of ``rank``'s pipeline train step for ``cfg`` (validated for
    ``world_size``), compiled as ``python -m lmfunc.train`` compiles it (module docstring); the
    experts' tokens evenly shared, or each rank's exchanged rows at ``expert_load`` times that share
    (``lmfunc.train.run_step.even_expert_share``)."""
    with even_expert_share(cfg, cfg.parallel.sizes(world_size), expert_load):
        return _trace_pipeline_rank(cfg, world_size, rank)


def _trace_pipeline_rank(cfg: TrainConfig, world_size: int, rank: int) -> StepFacts:
    from lmfunc.compiler.torch_compat.tracing import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    cfg = cfg.replace(run=dataclasses.replace(cfg.run, compile=True))
    run = cfg.run
    sizes = cfg.parallel.sizes(world_size)
    plan = batch_plan(cfg, world_size)
    microbatches = plan.num_microbatches_at(0)
    train_iters = run.train_iters if run.train_iters is not None else plan.train_iters_for_samples(run.train_samples)
    began = time.perf_counter()
    sink: list = []
    recorder = StepRecorder()
    with fake_world(world_size, rank), _dry_run_settings(recorder):
        mesh = mesh_of(sizes)
        pipe = pipeline_rank(cfg, Layout(dict(sizes), mesh))
        fake = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())  # .item() in a graph: a symbol
        with fake:  # leaves drawn on the CPU would be allocated whole before they are sharded
            params = init_rank_params(cfg.model, pipe, run.seed, torch.device("cpu"))
        tx, schedule = run_optimizer(cfg, plan, train_iters, params)
        loss_scale = cfg.precision.loss_scaling()
        step, _, _ = pipeline_steps(cfg, pipe, microbatches, tx, schedule, loss_scale,
                                    compute_dtype(cfg.precision.compute_dtype), torch.device("cpu"),
                                    backend_for=lambda options: capturing_backend(sink, options, recorder.runner))
        with fake:
            state = TrainState.create(params, tx, seed=run.seed, loss_scale=loss_scale)
            batch = fake_batch(cfg, microbatches, Layout(dict(sizes), None))
            recorder.hold((state, batch))
            recorder.start()
            inputs = recorder.live()
            with recorder:
                step(state, batch)
        names, dims_ranks = group_dims(mesh)
    return _facts(sink, recorder, inputs, names, dims_ranks, sizes, rank, microbatches, time.perf_counter() - began)


def _facts(sink: list, recorder: StepRecorder, inputs: int, names: dict[str, str], dims_ranks: dict[str, list[int]],
           sizes: dict[str, int], rank: int, microbatches: int, seconds: float) -> StepFacts:
    """The step facts of a recorded pipeline step whose captured graphs are ``sink``."""
    graphs = [CapturedStep(graph, graph_inputs, scheduled, names, dims_ranks, dict(sizes), rank, microbatches, 0.0)
              for graph, graph_inputs, scheduled in sink]
    calls = Counter(index for index, _, _, _ in recorder.calls)
    uses: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0, 0])

    def add(key: tuple[str, str], times: int, count: int, elements: Optional[int], nbytes: Optional[int]) -> None:
        entry = uses[key]
        entry[0] += times * count
        for slot, amount in ((1, elements), (2, nbytes)):  # None: known only at run time
            entry[slot] = None if entry[slot] is None or amount is None else entry[slot] + times * amount

    total_flops, sized = 0, 0
    for index, graph in enumerate(graphs):
        n = calls[index]
        for use in collectives(graph):
            add((use.kind, use.dims), n, use.count, use.elements, use.bytes)
        graph_flops, graph_sized = flops(graph)
        total_flops += n * graph_flops
        sized += n * graph_sized
    for kind, group, elements, nbytes in recorder.eager:
        add((kind, names.get(group, group)), 1, 1, elements, nbytes)
    collective_uses = [CollectiveUse(kind, dims, *entry) for (kind, dims), entry in sorted(uses.items())]
    def kept_terms(live: int, makers: Counter) -> list[tuple[str, int]]:
        return [("kept between the graphs (state, saved activations, gradients)", live),
                *((f"  of it, {maker}", size) for maker, size in makers.most_common(4))]

    peak, at = recorder.peak_between_graphs, "between the graphs"
    largest = kept_terms(peak, recorder.makers_at_peak)
    terms = plan_terms(recorder.makers_at_peak, recorder.graph_kinds, 0)
    for call, (index, live, freeable, makers) in enumerate(recorder.calls):
        scheduled = graphs[index].scheduled
        working = scheduled.peak_freeing(freeable)
        if live + working > peak:
            peak, at = live + working, f"call {call + 1} of {len(recorder.calls)}: captured graph {index}"
            largest = [*kept_terms(live, makers), ("the graph's own buffers at its peak", working)]
            terms = plan_terms(makers, recorder.graph_kinds, working)
    if recorder.kept_per_call:
        index, kept = max(recorder.kept_per_call.items(), key=lambda item: sum(item[1].values()))
        largest.append((f"of what is kept, one call of captured graph {index} keeps", sum(kept.values())))
        largest += [(f"  of it, made by {maker}", size) for maker, size in kept.most_common(3)]
    memory = MemoryReport(peak, inputs, at, largest, terms)
    traced = (f"the pipeline rank's step run on fake tensors: {len(graphs)} compiled graphs captured, called "
              f"{len(recorder.calls)} times over {microbatches} microbatches")
    return StepFacts(collective_uses, total_flops, sized, memory, dims_ranks, rank, seconds, traced)
