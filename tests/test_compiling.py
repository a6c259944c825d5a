import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch._inductor
from torch._guards import TracingContext

from lmfunc.compiler import compiling


def test_inductor_compiles_on_the_first_call_after_dynamo_capture(monkeypatch):
    """With Inductor, Dynamo's backend only keeps the graph: Inductor compiles it (with the recompute
    pass) on the first call, outside Dynamo's tracing (in a fresh tracing context whose shape
    environment holds no guards, for Inductor's cache), between two releases of the compile
    garbage; later calls compile nothing. Other backends compile as usual and release nothing."""
    events = []
    real_compile = torch._inductor.compile

    def recording_compile(graph, example_inputs, options):
        context = TracingContext.try_get()
        fresh = context is not None and context.fake_mode.shape_env is not None and not context.fake_mode.shape_env.guards
        events.append(("inductor", fresh, [type(p).__name__ for p in options["post_grad_custom_pre_pass"]]))
        return real_compile(graph, example_inputs, options)

    monkeypatch.setattr(torch._inductor, "compile", recording_compile)
    monkeypatch.setattr(compiling, "release_compile_garbage", lambda: events.append("release"))
    step = compiling.compile_step(lambda x, y: (x * y).sum())
    assert events == []
    for _ in range(3):
        assert float(step(torch.ones(4), torch.full((4,), 3.0))) == 12.0
    assert events == ["release", ("inductor", True, ["RematPass", "SliceCopyPass", "ReversedScanPass",
                                                    "AccumulationOrderPass"]), "release"]

    events.clear()
    eager = compiling.compile_step(lambda x, y: (x * y).sum(), backend="eager")
    for _ in range(2):
        assert float(eager(torch.ones(4), torch.full((4,), 3.0))) == 12.0
    assert events == []


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or platform.libc_ver()[0] != "glibc",
                    reason="needs Linux with glibc (malloc_trim)")
def test_release_compile_garbage_returns_free_heap_pages_to_the_os():
    """Blocks above pymalloc's 512 bytes come from glibc's heap; with every 16th kept alive the
    heap cannot shrink from its top, so only ``malloc_trim`` hands the freed pages back."""

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    blocks = [bytes(4000) for _ in range(20000)]
    kept = blocks[::16]
    del blocks
    before = rss_mib()
    compiling.release_compile_garbage()
    assert before - rss_mib() > 40, "75 MB freed in 4 KB blocks: most of it should leave the process"
    assert len(kept) == 1250


def test_importing_lmfunc_and_running_a_compiled_step_change_no_torch_setting():
    """lmfunc's torch settings (Dynamo's trace_autograd_ops, AOTAutograd's tag recompute, Inductor's
    in-place reuse) hold only while a step is traced or compiled: after importing every package
    and running a compiled step, torch's configs are what they were."""
    script = """
import torch, torch._dynamo, torch._functorch.config, torch._inductor.config, torch._inductor.scheduler
def snapshot():
    return (torch._dynamo.config.get_config_copy(), torch._functorch.config.get_config_copy(),
            torch._inductor.config.get_config_copy(),
            dict(vars(torch._inductor.scheduler.BaseSchedulerNode)))
before = snapshot()
import lmfunc, lmfunc.compiler, lmfunc.train, lmfunc.loss, lmfunc.parallel, lmfunc.checkpoint, lmfunc.data
assert snapshot() == before, "importing lmfunc changed a torch setting"
from lmfunc.compiler import compile_step
from lmfunc.grad import value_and_grad
grad_fn = compile_step(value_and_grad(lambda p: (p["w"] ** 2).sum()))
(_, grads) = grad_fn({"w": torch.ones(3)})
assert torch.equal(grads["w"], torch.full((3,), 2.0))
assert snapshot() == before, "a compiled step left a torch setting changed"
print("unchanged")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-3000:]


def test_tracing_settings_hold_only_on_calls_that_trace():
    """A compiled step runs its cached graph without the tracing settings (Dynamo's
    trace_autograd_ops, on torch 2.13+, and capture_scalar_outputs); the first call and a recompile
    (new shapes) trace with them, and every call returns the right gradient."""
    from lmfunc.compiler.torch_compat.tracing import TRACES_AUTOGRAD_GRAD
    from lmfunc.grad import value_and_grad

    seen = []

    def recording_backend(graph, example_inputs):
        def run(*args):
            config = torch._dynamo.config
            held = config.capture_scalar_outputs
            assert not TRACES_AUTOGRAD_GRAD or config.trace_autograd_ops == held
            seen.append(held)
            return graph(*args)
        return run

    step = compiling.compile_step(value_and_grad(lambda w: (w ** 2).sum()), backend=recording_backend)
    for n in (4, 4, 4, 5, 5):
        w = torch.arange(float(n))
        value, grad = step(w)
        assert float(value) == float((w ** 2).sum()) and torch.equal(grad, 2 * w)
    # Before 2.13 a recompile traces through torch.func and needs no setting, so nothing makes it
    # retry with them: it traces without capture_scalar_outputs, which only expert parallelism's
    # dropless exchange needs (refused compiled there: lmfunc.train.torch_support).
    assert seen == ([True, False, False, True, False] if TRACES_AUTOGRAD_GRAD else [True, False, False, False, False])
    assert torch._dynamo.config.trace_autograd_ops is False and torch._dynamo.config.capture_scalar_outputs is False


CACHED_STEP = """
import json, sys, torch
from torch._dynamo.utils import counters
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import adamw
from lmfunc.train import TrainState
from lmfunc.train.step import make_train_step
cfg = model_preset("tiny")
tx = adamw(1e-3)
state = TrainState.create(model.init(cfg, seed=0), tx)
tokens = torch.randint(0, cfg.vocab_size, (1, 2, 16), generator=torch.Generator().manual_seed(0))
state, metrics = make_train_step(cfg, tx, compile=True, donate_state=True)(state, {"tokens": tokens, "labels": tokens})
print(json.dumps({"loss": float(metrics["loss"]), **counters["inductor"], **counters["aot_autograd"]}))
"""


def _run_script(script: str, cache_dir, extra_env: dict | None = None) -> dict:
    """Run ``script`` in a fresh Python process with this Inductor cache dir; its last stdout line as JSON."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_restarted_process_loads_the_compiled_step_from_inductors_cache(tmp_path):
    """The step is compiled after Dynamo's capture, in a tracing context of its own with a shape
    environment, so Inductor's FX graph cache serves a restarted job instead of regenerating code;
    AOTAutograd's cache takes the step although it calls the chunked output layer's
    ``autograd.Function``, so the restart skips AOTAutograd's trace too."""
    cold, warm = _run_script(CACHED_STEP, tmp_path), _run_script(CACHED_STEP, tmp_path)
    assert cold.get("fxgraph_cache_miss") == 1 and "fxgraph_cache_bypass" not in cold
    assert cold.get("autograd_cache_miss") == 1 and cold.get("autograd_cache_saved") == 1
    assert "autograd_cache_bypass" not in cold
    assert warm.get("fxgraph_cache_hit") == 1 and warm.get("autograd_cache_hit") == 1
    assert warm["loss"] == cold["loss"]


MESH_STEP = """
import json, torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from lmfunc.compiler.compiling import compile_settings

def scaled(x, mesh):
    return (DTensor.from_local(x, mesh, [Replicate()]) * 2.0).to_local() + 1.0

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
hash(mesh)  # DTensor's caches hash the mesh before a stage compiles
with compile_settings():
    out = torch.compile(scaled, fullgraph=True, dynamic=False)(torch.arange(4.0), mesh)
print(json.dumps({"out": out.tolist(), **counters["inductor"]}))
"""


def test_a_graph_that_takes_a_device_mesh_is_served_from_the_cache_in_another_process(tmp_path):
    """A compiled function that takes a DTensor's ``DeviceMesh`` among its inputs, as a pipeline
    stage beside data parallelism does, compiles once: a second process, whose string hashes (and
    so the mesh's cached ``_hash``) differ, finds it in the FX graph cache
    (``lmfunc.compiler.mesh_cache_keys``). Without that, the key held the hash, and every restart
    of a pipeline run compiled its stages again."""
    first, second = (_run_script(MESH_STEP, tmp_path, {"PYTHONHASHSEED": seed}) for seed in ("1", "2"))
    assert first["out"] == second["out"] == [1.0, 3.0, 5.0, 7.0]
    assert first.get("fxgraph_cache_miss") == 1 and second.get("fxgraph_cache_hit") == 1
    assert "fxgraph_cache_miss" not in second


FUNCTION_STEP = """
import json, os, torch
from torch._dynamo.utils import counters
from lmfunc.compiler import compile_step
from lmfunc.grad import value_and_grad

class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x * BACKWARD_FACTOR

value, grad = compile_step(value_and_grad(lambda w: Square.apply(w).sum()))(torch.arange(3.0))
print(json.dumps({"grad": grad.tolist(), **counters["aot_autograd"]}))
"""


@pytest.mark.slow
def test_the_compile_cache_misses_when_an_autograd_functions_backward_changes(tmp_path):
    """lmfunc lets AOTAutograd cache graphs that call an ``autograd.Function``: this holds only
    because the Function's backward is traced into the cached graph's key. A restarted process
    whose Function computes another backward must compile again and get its own gradient."""
    def run(factor: str) -> dict:
        return _run_script(FUNCTION_STEP.replace("BACKWARD_FACTOR", factor), tmp_path)

    first, changed, again = run("2.0"), run("3.0"), run("2.0")
    assert first["grad"] == [0.0, 2.0, 4.0] and first.get("autograd_cache_miss") == 1
    assert changed["grad"] == [0.0, 3.0, 6.0] and changed.get("autograd_cache_miss") == 1
    assert again["grad"] == [0.0, 2.0, 4.0] and again.get("autograd_cache_hit") == 1


def test_the_first_call_freezes_older_objects_for_the_collector_and_restores_the_process():
    """While a step is traced and compiled, the process's older objects are frozen for Python's
    collector (its full collections then scan only the compile's objects); afterwards nothing is
    frozen, and a process that froze objects itself keeps exactly its own."""
    import gc

    from lmfunc.grad import value_and_grad

    seen = []

    def recording_backend(graph, example_inputs):
        seen.append(gc.get_freeze_count())
        return graph

    w = torch.arange(3.0)
    value, grad = compiling.compile_step(value_and_grad(lambda w: (w ** 3).sum()), backend=recording_backend)(w)
    assert torch.equal(grad, 3 * w ** 2)
    assert seen[0] > 1000 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        younger = [[] for _ in range(10_000)]
        compiling.compile_step(value_and_grad(lambda w: (w ** 3).sum()), backend=recording_backend)(w)
        assert seen[1] <= frozen and 0 < gc.get_freeze_count() <= frozen and len(younger) == 10_000
    finally:
        gc.unfreeze()


RETAINED_BACKWARD = """
import json, sys, torch
from lmfunc.compiler.compiling import retained_backward_settings

def f(x, w1, w2, w3):
    gated = torch.nn.functional.silu(x @ w1) * (x @ w2)
    return (torch.tanh(gated) @ w3).sum()

torch.manual_seed(0)
x = torch.randn(64, 32, requires_grad=True)
weights = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]
want = torch.autograd.grad(f(x, *weights), [x, *weights])
if MODE == "donated":  # torch's default: the backward may write into the saved activations
    torch.compile(f)(x, *weights).backward()
    errors = []
else:  # the pipeline's split backward: input gradients first, the graph kept, then the weights'
    with retained_backward_settings():
        loss = torch.compile(f)(x, *weights)
        got = torch.autograd.grad(loss, [x], retain_graph=True) + torch.autograd.grad(loss, weights)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
print(json.dumps({"errors": errors}))
"""


def test_a_backward_run_twice_is_right_after_the_cache_saw_the_donated_compile(tmp_path):
    """A process compiles ``f`` with AOTAutograd's donated buffers (torch's default), then another
    process sharing the compile cache runs ``f``'s compiled backward twice on one forward, as the
    pipeline's split backward does. Without the cache-key tag of ``retained_backward_settings``,
    torch 2.13 serves the donated backward again and the weight gradient of ``w1`` came out 4.5x
    off (measured); with it every gradient matches the eager one."""
    _run_script(RETAINED_BACKWARD.replace("MODE", "'donated'"), tmp_path)
    errors = _run_script(RETAINED_BACKWARD.replace("MODE", "'retained'"), tmp_path)["errors"]
    assert len(errors) == 4 and max(errors) < 1e-5, errors


def test_a_step_with_run_time_sizes_compiles_without_inductors_peak_memory_reordering(monkeypatch):
    """Inductor's peak-memory reordering counts a buffer whose size is known only at run time as 0
    bytes and would move such backward values into the forward; a graph with such sizes (Dynamo's
    ``unbacked_bindings``) compiles with it off, any other graph with the options it was given."""
    seen = []
    monkeypatch.setattr(torch._inductor, "compile", lambda graph, fakes, options: seen.append(options))
    graph = torch.fx.symbolic_trace(lambda x: x + 1)
    compiling._compile_static(graph, [torch.ones(2)], {"keep": 1})
    next(iter(graph.graph.nodes)).meta["unbacked_bindings"] = {"u0": ()}
    compiling._compile_static(graph, [torch.ones(2)], {"keep": 1})
    assert seen == [{"keep": 1}, {"keep": 1, **compiling.DATA_DEPENDENT_SIZE_OPTIONS}]
    assert compiling.DATA_DEPENDENT_SIZE_OPTIONS == {"reorder_for_peak_memory": False}


def test_lmfunc_compiles_kernels_without_line_tables_and_leaves_torchs_default_alone():
    """While lmfunc compiles, Inductor's C++ optimisation flags carry no line tables (``-g1`` or
    clang's ``-gline-tables-only``), which cost a fifth of each kernel's build and never change
    the code; outside, torch's default holds."""
    from torch._inductor import cpp_builder

    compiler = cpp_builder.get_cpp_compiler()
    line_tables = {"g1", "gline-tables-only"}
    assert line_tables & set(cpp_builder._get_optimization_cflags(compiler)[0])
    with compiling.compile_settings():
        assert not line_tables & set(cpp_builder._get_optimization_cflags(compiler)[0])
    assert line_tables & set(cpp_builder._get_optimization_cflags(compiler)[0])
