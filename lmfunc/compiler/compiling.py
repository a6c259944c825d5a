"""Compiling the train step: ``compile_step`` (``torch.compile`` with lmfunc's graph passes).

With the Inductor backend the step's graph is compiled in two stages. Dynamo captures the graph
as usual, but the backend it calls (``_inductor_on_first_call``) only keeps the graph; Inductor
compiles it when the captured code first runs it (``torch._inductor.compile``). By then Dynamo's
tracing state is garbage: it is collected first, so Dynamo's and Inductor's working objects are
never alive at once. Both are many small Python objects for the one large step graph, and the
arenas Python's allocator takes for them at the peak stay resident afterwards (a few long-lived
objects keep each arena), so a lower peak of live compile objects is a lower resting process.
After Inductor,
``release_compile_garbage`` frees the cyclic garbage and glibc's free heap pages before the
compiled code first runs (its first run already reaches the step's peak).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import types
from typing import Any, Callable, Iterator, Optional, Union

import torch

from lmfunc.compiler import inplace_reuse
from lmfunc.compiler.torch_compat.inductor import (cache_dir, inductor, inductor_config, no_line_tables,
                                                   post_grad_pre_passes)
from lmfunc.compiler.torch_compat.tracing import (TRACES_AUTOGRAD_GRAD, FakeTensorMode, TracingContext, Unsupported,
                                                  dynamo_config, functorch_config, tracing)
from lmfunc.compiler.cpp_flags import gcc_flags_for_correct_kernels
from lmfunc.compiler.accumulation_order import AccumulationOrderPass
from lmfunc.compiler.collective_buckets import DEFAULT_BUCKET_MB, CollectiveBucketsPass
from lmfunc.compiler.isa_probe import start_vec_isa_probe
from lmfunc.compiler.kernel_batches import batched_cpu_kernels
from lmfunc.compiler.mesh_cache_keys import stable_mesh_cache_keys
from lmfunc.compiler.recompute_pass import RematPass
from lmfunc.compiler.reversed_scan import ReversedScanPass
from lmfunc.compiler.saved_rng_states import saved_rng_states_before_opaque_objects
from lmfunc.compiler.view_copies import SliceCopyPass


def release_compile_garbage() -> None:
    """Free what compiling left behind: the cyclic garbage (graphs and the objects they hold:
    tens of MiB that Python's generational collector may not free for a long time), then the free
    pages inside glibc's heap (``malloc_trim``: Inductor's code generation leaves them resident).
    Elsewhere than glibc only the first."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _inductor_on_first_call(options: dict[str, Any]) -> Callable:
    """A Dynamo backend that returns at once and compiles the captured graph with Inductor (with
    these config ``options``) on its first call, with that call's inputs as example inputs, after
    Dynamo's capture has ended; ``release_compile_garbage`` runs before and after the compile. The
    torch settings lmfunc's passes need (``compile_settings``) hold during that compile only."""

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = None

        def run(*args):
            nonlocal compiled
            if compiled is None:
                release_compile_garbage()
                with compile_settings(), host_compile_turn(args):
                    compiled = _compile_static(graph, list(args), options)
                release_compile_garbage()
            return compiled(*args)

        return run

    return backend


COMPILE_LOCK = "lmfunc-compile.lock"
"""The file in the Inductor cache directory whose lock a rank holds while Inductor compiles."""


@contextlib.contextmanager
def host_compile_turn(args: tuple) -> Iterator[None]:
    """While Inductor compiles a graph of a multi-process run on the CPU whose ranks trace alike (a
    1-D mesh other than a pipeline's, ``lmfunc.parallel.mesh.ranks_compile_in_turn``): an
    exclusive ``flock`` on ``COMPILE_LOCK`` in their shared Inductor cache directory, waited for. The
    ranks of one host share the CPU's cores, so they compile one after another and a graph all of
    them trace alike is compiled once: the others find it in Inductor's cache. No collective runs
    while the lock is held (the compile is local), so no rank waits for one that waits for the lock.
    Otherwise (one process, a larger mesh, a pipeline, CUDA, where every rank has cores of its own)
    nothing."""
    import fcntl
    import os

    import torch.distributed as dist

    from lmfunc.parallel.mesh import ranks_compile_in_turn

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not (dist.is_available() and dist.is_initialized() and ranks_compile_in_turn()) or not tensors or any(
            t.device.type != "cpu" for t in tensors):
        yield
        return
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), COMPILE_LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


DATA_DEPENDENT_SIZE_OPTIONS = {"reorder_for_peak_memory": False}
"""Inductor settings for a step with sizes known only at run time (the rows expert parallelism's
all-to-all delivers). Inductor's reordering for peak memory counts a buffer of such a size as 0
bytes, so it computes backward values of that size (the experts' recomputed activations, copies
of their rows) during the forward and holds them until the backward (docs/performance.md,
"Expert parallelism, dropless")."""


def options_for_graph(graph: torch.fx.GraphModule, options: dict[str, Any]) -> dict[str, Any]:
    """Inductor ``options`` for this step graph: with ``DATA_DEPENDENT_SIZE_OPTIONS`` added when a
    node of it has a size known only at run time (an unbacked size)."""
    if any(node.meta.get("unbacked_bindings") is not None for node in graph.graph.nodes):
        return {**options, **DATA_DEPENDENT_SIZE_OPTIONS}
    return options


def _compile_static(graph: torch.fx.GraphModule, args: list, options: dict[str, Any]) -> Callable:
    """``torch._inductor.compile`` of ``graph`` for ``args`` after Dynamo's own tracing context is
    gone, in a fresh one: the arguments as static-shaped fake tensors of a fake mode with an
    (empty) shape environment. Inductor's FX graph cache keys its entries on that environment's
    guards and bypasses the cache without one; with it, a restarted job loads the compiled step
    from the cache instead of generating its code again."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    options = options_for_graph(graph, options)
    for node in graph.graph.nodes:
        node.meta.pop("unbacked_bindings", None)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with tracing(TracingContext(fake_mode)):
        fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
        return inductor.compile(graph, fakes, options)


_CACHEABLE_OPERATORS = {"torch.ops.higher_order.scan": torch.__version__}
"""Higher-order operators the compile caches may take (``compile_settings``), keyed by the torch
version as Inductor's ``unsafe_marked_cacheable_functions`` asks."""


@contextlib.contextmanager
def compile_settings():
    """While AOTAutograd and Inductor compile the step: AOTAutograd's own recompute of tagged ops
    is off (``lmfunc.compiler.recompute_pass`` does it, per microbatch), Inductor reuses a matmul's
    buffer in place although the graph writes into its inputs (``inplace_reuse``), and
    AOTAutograd's cache takes graphs that call an ``autograd.Function`` (the chunked output
    layer's). torch leaves that cache off for them by default because a Function's Python code
    need not be in the graph; under ``fullgraph=True`` Dynamo traces its forward and backward
    into subgraphs of the step's graph, which the cache key hashes, so a changed Function is a
    miss (``tests/test_compiling.py`` checks this). With it, a restarted job skips AOTAutograd's
    trace of the step as well as Inductor's. Both caches also take graphs with torch's ``scan``
    (``ModelConfig.scan_layers``), which torch 2.13 leaves out of them only because it has not
    opted that operator in: its body is a subgraph of the step's graph, hashed into the key like
    any other node (``tests/test_scan_layers.py`` checks that a changed body misses). GCC compiles
    the kernels with the flags that keep them correct (``lmfunc.compiler.cpp_flags``) and without
    line tables (``-g1``): debug information never changes the machine code GCC generates, and
    leaving it out shortens each kernel's build (docs/performance.md, "Where a cold compile goes");
    a profiler then names each kernel but not its source lines. The kernels of a graph are built
    in a few GCC runs, many kernels to each, instead of one run per kernel
    (``lmfunc.compiler.kernel_batches``): most of a run's cost is fixed. A graph that takes a
    ``DeviceMesh`` gets the same cache key in every process (``lmfunc.compiler.mesh_cache_keys``),
    and a recomputed random op's saved RNG state is placed before the saved ``DeviceMesh``
    (``lmfunc.compiler.saved_rng_states``)."""
    with functorch_config.patch(
        remat_using_tags_for_fwd_loss_bwd_graph=False, autograd_cache_allow_custom_autograd_functions=True
    ):
        with inductor_config.patch({"unsafe_marked_cacheable_functions": _CACHEABLE_OPERATORS, **no_line_tables()}):
            with inplace_reuse.inplace_reuse_despite_input_writes(), gcc_flags_for_correct_kernels(), \
                    batched_cpu_kernels(), stable_mesh_cache_keys(), saved_rng_states_before_opaque_objects():
                yield


RETAINED_BACKWARD_CACHE_TAG = "lmfunc-retained-backward"
"""What ``retained_backward_settings`` adds to torch's compile-cache key tag."""


@contextlib.contextmanager
def retained_backward_settings():
    """While compiling and running a compiled function whose backward runs more than once on one
    forward (``retain_graph``: the pipeline's split backward runs it for the input gradients, then
    again for the weight gradients). AOTAutograd's donated buffers let Inductor's backward write
    into the saved activations, which a second backward would then read; torch refuses such a
    backward unless ``torch._functorch.config.donated_buffer`` is off, a setting it reads when it
    compiles and again in every backward, so this holds it off throughout. It also adds
    ``RETAINED_BACKWARD_CACHE_TAG`` to the compile-cache key tag: in torch 2.13 Inductor's FX graph
    cache key leaves out which buffers are donated, so a backward compiled earlier with donated
    buffers (by any process sharing the cache) would be reused here and overwrite what the second
    backward reads: silently wrong gradients (``tests/test_compiling.py`` reproduces it)."""
    tag = torch.compiler.config.cache_key_tag
    tag = tag if RETAINED_BACKWARD_CACHE_TAG in tag else f"{tag}+{RETAINED_BACKWARD_CACHE_TAG}".lstrip("+")
    with functorch_config.patch(donated_buffer=False), torch.compiler.config.patch(cache_key_tag=tag):
        yield


def tracing_settings() -> contextlib.AbstractContextManager:
    """The Dynamo settings a step needs while it is traced: ``torch.autograd.grad`` (``lmfunc.grad``)
    traced into the graph, through the private ``torch._dynamo.config.trace_autograd_ops``
    (``tests/test_grad.py`` fails if it stops working), and ``capture_scalar_outputs``, so that
    the data-dependent sizes of expert parallelism's dropless all-to-all (``.tolist()`` of the
    exchanged counts, ``lmfunc.parallel.expert_parallel``) become unbacked sizes inside the one
    graph instead of a graph break. lmfunc never sets them globally: importing lmfunc changes no
    torch setting (``tests/test_compiling.py``)."""
    if not TRACES_AUTOGRAD_GRAD:  # older torch differentiates a compiled step with torch.func (lmfunc.grad)
        return dynamo_config.patch(capture_scalar_outputs=True)
    return dynamo_config.patch(trace_autograd_ops=True, capture_scalar_outputs=True)


def with_own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (same bytecode, globals, closure and defaults).

    Dynamo keeps compiled graphs per code object, at most ``torch._dynamo.config.recompile_limit``
    (8) of them, guarded on the closure's values. Every step ``make_train_step`` builds is a closure
    over the same source function, so without this the ninth step built in one process fails
    (``fullgraph=True`` turns the limit into an error), and a discarded step's graphs stay cached.
    With its own code object each step has its own cache, freed with the step.
    """
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)


def inductor_options(choose_saved: bool, bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB) -> dict[str, Any]:
    """The Inductor config options of every lmfunc compile: the recompute pass on the step's
    graph, the slice copies of scan bodies made fusible (``view_copies``), the lowering of the
    backward's reversed scans (``reversed_scan``) and each microbatch's gradients summed before the
    next microbatch (``accumulation_order``), then the
    bucketing and overlap of its collectives (``collective_buckets``; all-reduce buckets of at
    most ``bucket_size_mb`` MiB; None: no such pass)."""
    options: dict[str, Any] = {"post_grad_custom_pre_pass": post_grad_pre_passes(
        [RematPass(choose_saved), SliceCopyPass(), ReversedScanPass(), AccumulationOrderPass()])}
    if bucket_size_mb is not None:
        options["post_grad_custom_post_pass"] = CollectiveBucketsPass(bucket_size_mb)
    return options


def compile_graph(fn: Callable, backend: Union[str, Callable] = "inductor", choose_saved: bool = True,
                  bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB) -> Callable:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` with lmfunc's recompute pass; call the
    result through ``call_compiled`` (``compile_step`` does both).

    Each call compiles a copy of ``fn`` with its own code object (``with_own_code``): steps built
    from the same function never share, or exhaust, one Dynamo cache.

    With the Inductor backend the recompute pass (``lmfunc.compiler.recompute_pass``) runs on the step's graph,
    Inductor keeps its in-place buffer reuse although the graph writes into its inputs
    (``lmfunc.compiler.inplace_reuse``), and Inductor compiles on the first call, after Dynamo's
    capture (see the module docstring). Other backends get the graph without any of these
    (recompute tags are then ignored: numerically the same, more memory).
    choose_saved: recompute cheap forward ops in the backward where that keeps fewer bytes
        (``lmfunc.compiler.saved_values``); False keeps every forward value a backward op reads.
    bucket_size_mb: the largest data-parallel all-reduce bucket (``collective_buckets``); None
        leaves the collectives unbucketed.
    """
    if backend == "inductor":
        backend = _inductor_on_first_call(inductor_options(choose_saved, bucket_size_mb))
    return torch.compile(with_own_code(fn), fullgraph=True, dynamic=False, backend=backend)


@contextlib.contextmanager
def _older_objects_frozen():
    """Python's garbage collector skips the objects that exist on entry until exit (``gc.freeze``),
    unless the process froze objects of its own. A compile creates hundreds of thousands of short-
    lived objects, which trigger full collections, and ``release_compile_garbage`` runs two more:
    with the process's older objects (torch's modules, the model, the data) frozen, each of these
    scans only what the compile made. Older objects that become garbage meanwhile are collected
    after exit."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def call_compiled(compiled: Callable, probe_cpu_isa: bool = False) -> Callable:
    """``compiled`` (a ``compile_graph`` result) called with ``tracing_settings()`` held only on the
    calls where Dynamo traces: the first call, and a later call that recompiles. With
    ``probe_cpu_isa`` (an Inductor compile) the first call on CPU tensors also starts Inductor's
    vector-ISA probe beside the trace (``lmfunc.compiler.isa_probe``).

    Dynamo does not guard its compiled graphs on its config, so the cached graph runs without the
    setting. A recompile that starts without it stops with ``torch._dynamo.exc.Unsupported`` while
    tracing, before anything has run; that call is then made again with the setting held (a second
    ``Unsupported`` has another cause and is raised). Between compiles no torch setting changes
    while a step runs, also not for the process's other threads (prefetch, checkpoint writer).
    """
    traced = False

    def call(*args, **kwargs):
        nonlocal traced
        if traced:
            try:
                return compiled(*args, **kwargs)
            except Unsupported:
                pass
        if probe_cpu_isa and not traced:
            start_vec_isa_probe((args, kwargs))
        with tracing_settings(), _older_objects_frozen():
            out = compiled(*args, **kwargs)
        traced = True
        return out

    return call


def compile_step(fn: Callable, backend: Union[str, Callable] = "inductor", choose_saved: bool = True,
                 bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB) -> Callable:
    """``call_compiled(compile_graph(fn, backend, choose_saved))``: the way to compile any function
    that differentiates with ``lmfunc.grad.value_and_grad``."""
    return call_compiled(compile_graph(fn, backend, choose_saved, bucket_size_mb), probe_cpu_isa=backend == "inductor")
