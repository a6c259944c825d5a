"""The step graph of one rank of a target world, traced and never run.

The trainer's own step (``lmfunc.train.run_step.run_train_step``, the same optimizer, loss scaling,
clipping and bucketing) is called on state made of fake tensors (``FakeTensorMode``: shapes,
dtypes and placements, no data) over the run's mesh on a fake process group
(``lmfunc.dryrun.world``). Dynamo traces it as it would for the run; its backend hands the graph to
Inductor with lmfunc's options (``lmfunc.compiler.compiling``), and Inductor runs AOTAutograd,
every post-grad pass (lmfunc's recompute, slice-copy, scan and collective-bucketing passes
included), its lowering and its scheduler (fusion, reordering). The capture stops there, before
code generation: the graph is the one Inductor would compile, with the collectives it would
issue, and the scheduler's buffers are the ones the compiled step would allocate."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from lmfunc.compiler.collective_buckets import DEFAULT_BUCKET_MB
from lmfunc.compiler.torch_compat.inductor import inductor_config
from lmfunc.compiler.torch_compat.tracing import functorch_config
from lmfunc.compiler.compiling import compile_settings, inductor_options, options_for_graph
from lmfunc.compiler.saved_values import size_estimate
from lmfunc.config.train import TrainConfig
from lmfunc.data.batch import lm_batch
from lmfunc.dryrun.buffer_terms import split_peak
from lmfunc.dryrun.world import fake_world, group_dims, mesh_of
from lmfunc.parallel.mesh import Layout
from lmfunc.parallel.sharding import local_batch_to_dtensor
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.train.make_optimizer import run_optimizer
from lmfunc.train.params import init_params
from lmfunc.train.run_step import run_train_step
from lmfunc.train.state import TrainState


class _Captured(Exception):
    """Raised where the capture ends, so that nothing is lowered, compiled or run."""


@dataclasses.dataclass
class CapturedStep:
    """One rank's train step as Inductor would compile it."""

    graph: torch.fx.GraphModule
    """After AOTAutograd and Inductor's post-grad passes."""
    inputs: list
    """The graph's example inputs (fake tensors, the state's and the batch's local shards)."""
    scheduled: ScheduledMemory
    """Inductor's scheduled buffers of the graph (the peak beyond the inputs)."""
    group_dims: dict[str, str]
    """Process group name -> the mesh dims it spans (``lmfunc.dryrun.world.group_dims``)."""
    dims_ranks: dict[str, list[int]]
    """Mesh dims (as in ``group_dims``) -> the ranks of this rank's group over them."""
    sizes: dict[str, int]
    rank: int
    microbatches: int
    trace_seconds: float


@dataclasses.dataclass(frozen=True)
class ScheduledMemory:
    """Inductor's own account of the step's buffers (``torch._inductor.memory``), in the order its
    scheduler runs them after fusion: what the compiled step would allocate beyond its inputs."""

    peak: int
    """Bytes of the buffers live at the peak (the graph's inputs not counted)."""
    at_step: int
    """The scheduled (fused) node at which the peak is reached, of ``steps``."""
    steps: int
    largest: list[tuple[str, int]]
    """The largest buffers live at the peak: (buffer name and the ops it holds, bytes)."""
    per_step: tuple[int, ...] = ()
    """Bytes of the buffers live at each scheduled node."""
    terms: tuple[tuple[str, int], ...] = ()
    """``peak`` split into gradients, kept activations and working set by the values its buffers hold
    (``lmfunc.dryrun.buffer_terms``)."""
    input_last_uses: tuple[tuple[int, int, int], ...] = ()
    """(position among the graph's inputs, the scheduled node that last reads it, its bytes) of each
    input tensor: the compiled graph frees an input after that node unless its caller holds it."""

    def peak_freeing(self, freeable: set[int]) -> int:
        """The peak beyond the graph's inputs when the inputs at the positions ``freeable`` are freed
        after their last use (where they no longer count against the buffers); at least 0."""
        freed_at = [0] * (len(self.per_step) + 1)
        for position, last_use, size in self.input_last_uses:
            if position in freeable:
                freed_at[last_use + 1] += size
        peak, freed = 0, 0
        for step, live in enumerate(self.per_step):
            freed += freed_at[step]
            peak = max(peak, live - freed)
        return peak


def _input_last_uses(lowering, nodes: list) -> tuple[tuple[int, int, int], ...]:
    """``ScheduledMemory.input_last_uses`` of a scheduled ``GraphLowering``."""
    from lmfunc.compiler.torch_compat.scheduling import get_freeable_input_buf
    from lmfunc.compiler.torch_compat.inductor import OrderedSet

    step_of = {node: step for step, node in enumerate(nodes)}
    names = list(lowering.graph_input_names)
    uses = []
    for name, buffer in get_freeable_input_buf(nodes, OrderedSet(names)).items():
        readers = buffer.mpi_buffer.succ_nodes
        if readers and name in names:
            uses.append((names.index(name), max(step_of[node] for node in readers), buffer.mpi_buffer.size_free))
    return tuple(uses)


def _allocate_with_first_writer(infos: list) -> None:
    """Correct Inductor's buffer timeline (``torch._inductor.memory.BufferInfo``s, in place) for
    buffers written in slices: a concatenation's inputs (a collective bucket's gradients, say) are
    computed straight into their slices of its buffer (``ir.NonOwningLayout``), so the compiled code
    allocates that buffer before its first slice is written, not at the concatenation, and the
    slices allocate nothing. Inductor's timeline counts each slice from its writer and the whole
    buffer from the concatenation on: a data-parallel step's gradient bucket, written from the
    backward's first gradient on, went missing from the peak."""
    from lmfunc.compiler.torch_compat.scheduling import NonOwningLayout

    by_name = {info.buffer.get_name(): info for info in infos}
    for info in infos:
        layout = getattr(getattr(info.buffer, "node", None), "layout", None)
        if not isinstance(layout, NonOwningLayout):
            continue
        owner = by_name.get(layout.view.get_name())
        if owner is None:
            continue
        owner.start_step = min(owner.start_step, info.start_step)
        info.size_alloc = info.size_free = 0


def _size_unknowns(lowering, infos: list) -> None:
    """Size the buffers whose sizes are known only at run time (the experts' exchanged rows under
    expert parallelism) at their estimate, each unknown at Inductor's ``unbacked_symint_fallback``
    (``lmfunc.train.run_step.even_expert_share`` inside a dry run), in place. Inductor's timeline
    (``torch._inductor.memory``) counts them as 0 bytes, which hid most of an expert-parallel step's
    working set; the sizes follow Inductor's own rules otherwise (a renamed mutation and a buffer
    with no layout hold nothing; a multi-output kernel allocates its outputs)."""
    from lmfunc.compiler.torch_compat.scheduling import MultiOutput, MultiOutputLayout, NoneLayout
    from lmfunc.compiler.torch_compat.scheduling import get_dtype_size
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    fallback = inductor_config.unbacked_symint_fallback
    renamed = lowering.scheduler.mutation_real_name
    by_name = {info.buffer.get_name(): info for info in infos}
    for info in infos:
        node = getattr(info.buffer, "node", None)
        if node is None or info.buffer.get_name() in renamed or isinstance(node.layout, (NoneLayout, MultiOutputLayout)):
            continue
        numel = node.get_numel()
        if not free_unbacked_symbols(numel):
            continue
        size = lowering.sizevars.optimization_hint(numel, fallback=fallback) * get_dtype_size(node.get_dtype())
        owner = by_name.get(node.inputs[0].get_name()) if isinstance(node, MultiOutput) and node.inputs else None
        if owner is not None:
            owner.size_alloc += size - info.size_free
        else:
            info.size_alloc = size
        info.size_free = size


def _scheduled_memory(lowering, largest: int = 5) -> ScheduledMemory:
    """``ScheduledMemory`` of a ``GraphLowering`` whose scheduler has been built."""
    from lmfunc.compiler.torch_compat.scheduling import compute_memory_timeline, peak_memory_from_buf_info_list, prepare_planning_info
    from lmfunc.compiler.torch_compat.inductor import OrderedSet

    scheduler = lowering.scheduler
    nodes, outputs = scheduler.nodes, OrderedSet(lowering.get_output_names())
    _, freeable = prepare_planning_info(nodes, scheduler.name_to_buf, scheduler.name_to_fused_node, OrderedSet(), outputs)
    infos, _, _ = compute_memory_timeline(nodes, freeable, outputs)
    _size_unknowns(lowering, infos)
    _allocate_with_first_writer(infos)
    peak, per_step = peak_memory_from_buf_info_list(infos, len(nodes))
    at = max(range(len(per_step)), key=per_step.__getitem__) if per_step else 0
    live = [info for info in infos if info.start_step <= at and (info.end_step == -1 or info.end_step >= at)]
    live.sort(key=lambda info: -info.size_alloc)

    def name(info) -> str:
        buffer = info.buffer
        origins = getattr(getattr(buffer, "node", None), "origins", None) or ()
        ops = sorted({str(getattr(o, "target", o)) for o in origins})[:3]
        return f"{buffer.get_name()} ({', '.join(ops)})" if ops else buffer.get_name()

    return ScheduledMemory(peak, at, len(nodes), [(name(info), info.size_alloc) for info in live[:largest]],
                           tuple(per_step), split_peak(lowering.orig_gm.graph, infos, at, peak) if per_step else (),
                           _input_last_uses(lowering, nodes))


@contextlib.contextmanager
def _stop_at_code_generation(sink: list) -> Iterator[None]:
    """While inside: Inductor lowers a graph and schedules it (fusion and Inductor's reordering, as
    when it compiles), then, instead of generating code, puts (the post-grad graph, its example
    inputs, ``ScheduledMemory``) in ``sink`` and raises ``_Captured``."""
    from unittest import mock

    from lmfunc.compiler.torch_compat.scheduling import GraphLowering

    def codegen(lowering):
        lowering.init_wrapper_code()
        lowering._update_scheduler()
        sink.append((lowering.orig_gm, list(lowering.example_inputs), _scheduled_memory(lowering)))
        raise _Captured()

    with mock.patch.object(GraphLowering, "codegen", codegen):
        yield


NO_COMPILE_CACHES = {"fx_graph_cache": False, "fx_graph_remote_cache": False}
"""Inductor options of a dry run: a graph found in the compile cache would skip the passes and
the lowering the capture reads."""


GraphRunner = Callable[[int, torch.fx.GraphModule, str], Callable]
"""``runner(index, graph, kind)``: a boxed callable that runs ``graph`` (AOTAutograd's forward or
backward graph, before Inductor's passes), the ``index``-th graph put in the sink; ``kind`` is
``"forward"``, ``"backward"`` or ``"inference"`` (a function compiled without autograd)."""


def capturing_backend(sink: list, options: dict, runner: Optional[GraphRunner] = None) -> Callable:
    """A Dynamo backend that runs a graph through Inductor as lmfunc compiles it (Inductor
    ``options``, such as ``inductor_options``, under ``compile_settings``): AOTAutograd, the
    post-grad passes, lowering and scheduling, and stops before code generation, putting each graph
    Inductor would compile (a forward and, at the first backward, a backward for a function that
    AOTAutograd differentiates; one graph for the train step) in ``sink``.

    Without a ``runner`` the function it returns raises ``_Captured`` instead of running. With one,
    each of AOTAutograd's graphs runs as ``runner`` makes it run (on fake tensors), so that code
    around it (a pipeline schedule) goes on.

    Each backward is captured with its forward, not at its first call: AOTAutograd's lazy backward
    compile deep-copies the backward graph, whose lifted constants are real tensors, and under the
    fake mode that surrounds a pipeline step the copy fails (a deepseek-v3-tiny stage on pp 2)."""
    from lmfunc.compiler.torch_compat.scheduling import compile_fx, compile_fx_inner
    from lmfunc.compiler.torch_compat.scheduling import InductorError

    def inner(graph: torch.fx.GraphModule, example_inputs: list, **kwargs) -> Callable:
        if runner is not None:
            copied = torch.fx.Graph()
            copied.output(copied.graph_copy(graph.graph, {}))
            runnable = torch.fx.GraphModule(graph, copied)  # before the passes rewrite ``graph``
        try:
            with _stop_at_code_generation(sink):
                compile_fx_inner(graph, example_inputs, **kwargs)
        except _Captured:
            pass
        except InductorError as error:  # Inductor wraps what its compile raises
            if not isinstance(error.inner_exception, _Captured):
                raise
        if runner is None:
            raise _Captured()
        kind = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        return runner(len(sink) - 1, runnable, kind)

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        patches = {**options_for_graph(graph, options), **NO_COMPILE_CACHES}
        try:
            with compile_settings(), functorch_config.patch(enable_autograd_cache=False,
                                                                   force_non_lazy_backward_lowering=True):
                return compile_fx(graph, example_inputs, inner_compile=inner, config_patches=patches)
        except _Captured:
            pass
        except InductorError as error:
            if not isinstance(error.inner_exception, _Captured):
                raise

        def stopped(*args):
            raise _Captured()

        return stopped

    return backend


def fake_batch(cfg: TrainConfig, microbatches: int, layout: Layout) -> dict:
    """A batch of the run's fields and this rank's shapes (``[M, micro, S]``; DTensors of the global
    batch on a mesh), as ``lmfunc.train.run_data.global_batch_part`` makes it; the values are
    zeros (only shapes are traced)."""
    d = cfg.data
    samples = torch.zeros(microbatches, cfg.run.micro_batch_size, d.seq_length + 1, dtype=torch.int64)
    batch = lm_batch(samples, -1, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss, None)
    return local_batch_to_dtensor(batch, layout.mesh) if layout.mesh is not None else batch


StepInputs = Callable[[Layout, Callable], tuple[Callable, Any, dict]]
"""``make(layout, backend) -> (step, state, batch)``: a step function compiled with ``backend`` and
the state and batch to call it with, made on ``layout`` (inside ``FakeTensorMode``)."""


def trace(world_size: int, rank: int, sizes: dict[str, int], make: StepInputs,
          bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB, microbatches: int = 1) -> CapturedStep:
    """The graph of the step ``make`` builds for ``rank`` of a world of ``world_size`` ranks with the
    mesh ``sizes`` (resolved), traced on fake tensors and a fake process group: nothing is
    allocated but the trace's own memory."""
    from lmfunc.compiler.torch_compat.tracing import FakeTensorMode

    began = time.perf_counter()
    with fake_world(world_size, rank):
        mesh: Optional[DeviceMesh] = mesh_of(sizes)
        layout = Layout(dict(sizes), mesh)
        sink: list = []
        with FakeTensorMode(allow_non_fake_inputs=True):
            step, state, batch = make(layout, capturing_backend(sink, inductor_options(True, bucket_size_mb)))
            try:
                step(state, batch)
            except _Captured:
                pass
        if not sink:
            raise RuntimeError("the dry run's trace ended before Inductor's scheduler; was the step compiled with "
                               "the backend it was given?")
        graph, inputs, scheduled = sink[-1]
        return CapturedStep(graph, inputs, scheduled, *group_dims(mesh), dict(sizes), rank, microbatches,
                            time.perf_counter() - began)


def estimated(value) -> Optional[int]:
    """``value`` as an int: a symbolic size at its estimate (each unknown at Inductor's
    ``unbacked_symint_fallback``: ``lmfunc.train.run_step.even_expert_share`` inside a dry run);
    None for anything else."""
    return size_estimate(value) if isinstance(value, (int, torch.SymInt)) else None


def batch_plan(cfg: TrainConfig, world_size: int) -> BatchPlan:
    """The run's batch plan (microbatches per step) on ``world_size`` ranks."""
    return BatchPlan.from_config(cfg.run, Layout(cfg.parallel.sizes(world_size), None).data_parallel_size)


def trace_rank(cfg: TrainConfig, world_size: int, rank: int = 0) -> CapturedStep:
    """The train step ``python -m lmfunc.train`` runs for ``cfg`` (validated for ``world_size``) on
    ``rank`` of a world of ``world_size`` ranks (``lmfunc.train.run_step.run_train_step``, compiled),
    traced (``trace``)."""
    run = cfg.run
    sizes = cfg.parallel.sizes(world_size)
    plan = batch_plan(cfg, world_size)
    microbatches = plan.num_microbatches_at(0)
    train_iters = run.train_iters if run.train_iters is not None else plan.train_iters_for_samples(run.train_samples)

    def make(layout: Layout, backend: Callable) -> tuple[Callable, Any, dict]:
        params = init_params(cfg.model, layout.mesh, seed=run.seed)
        tx, schedule = run_optimizer(cfg, plan, train_iters, params)
        state = TrainState.create(params, tx, seed=run.seed, loss_scale=cfg.precision.loss_scaling())
        step = run_train_step(cfg, tx, schedule, layout.mesh is not None, backend=backend, compile=True)
        return step, state, fake_batch(cfg, microbatches, layout)

    buckets = cfg.parallel.bucket_size_mb if cfg.parallel.bucket_collectives else None
    return trace(world_size, rank, sizes, make, buckets, microbatches)
