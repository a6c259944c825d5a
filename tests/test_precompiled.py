"""The precompiled step (``lmfunc.compiler.precompiled``): saved whole on its first call, loaded by
a restarted process without Dynamo tracing it, bit-identical to the ordinary compiled step, and
found by a key that changes with every value and piece of code the trace baked in."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lmfunc.compiler import compile_step, precompiled_step
from lmfunc.grad import value_and_grad

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN_STEPS = """
import json, sys, torch
from torch._dynamo.utils import counters
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import adamw
from lmfunc.train import TrainState
from lmfunc.train.step import make_train_step
from lmfunc.tree import tree_leaves

def run(precompile):
    cfg = model_preset("tiny", scan_layers=sys.argv[2] == "scan")
    tx = adamw(1e-3)
    state = TrainState.create(model.init(cfg, seed=0), tx)
    tokens = torch.randint(0, cfg.vocab_size, (1, 2, 16), generator=torch.Generator().manual_seed(0))
    step = make_train_step(cfg, tx, compile=True, donate_state=True, precompile=precompile)
    losses = []
    for _ in range(2):
        state, metrics = step(state, {"tokens": tokens, "labels": tokens})
        losses.append(float(metrics["loss"]))
    return losses, torch.cat([p.flatten() for p in tree_leaves(state.params)]).tolist()

losses, params = run(True)
captured = dict(counters["stats"])
ordinary = run(False) if sys.argv[1] == "compare" else None
print(json.dumps({"losses": losses, "params": params, "captured": captured.get("calls_captured", 0),
                  "ordinary": ordinary}))
"""


def _run(script: str, cache_dir, *argv: str) -> tuple[dict, str]:
    """Run ``script`` in a fresh Python process with this Inductor cache dir and one thread: its
    last stdout line as JSON, and its stderr."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("layers", ["unrolled", pytest.param("scan", marks=pytest.mark.slow)])
def test_a_restarted_process_loads_the_saved_train_step_without_tracing_it(tmp_path, layers):
    """The first process traces and saves the step; the second loads it, Dynamo captures nothing,
    and two steps give the first process's losses and parameters bit for bit, which are also
    those of the ordinary compiled step. The same with ``model.scan_layers`` (a graph with torch's
    ``scan``, whose saved guards need a tracing context to load)."""
    cold, _ = _run(TRAIN_STEPS, tmp_path, "first", layers)
    assert cold["captured"] > 0
    assert len(list((tmp_path / "lmfunc_steps").glob("*.bin"))) == 1
    built = sorted(path.name for path in tmp_path.rglob("*.so"))
    warm, stderr = _run(TRAIN_STEPS, tmp_path, "compare", layers)
    assert "precompiled step" not in stderr
    assert warm["captured"] == 0
    # Both the loaded step and the ordinary one took every C++ library from the cache, the
    # kernels' batches included (lmfunc.compiler.kernel_batches): nothing was built again.
    assert sorted(path.name for path in tmp_path.rglob("*.so")) == built
    assert warm["losses"] == cold["losses"] and warm["params"] == cold["params"]
    ordinary_losses, ordinary_params = warm["ordinary"]
    assert ordinary_losses == warm["losses"] and ordinary_params == warm["params"]


KEYED_STEP = """
import json, sys, torch
from torch._dynamo.utils import counters
from lmfunc.compiler import precompiled_step
from lmfunc.grad import value_and_grad
import user_objective

def make(weight):
    return precompiled_step(value_and_grad(lambda w: user_objective.objective(w) * weight))

value, grad = make(float(sys.argv[1]))(torch.arange(4.0))
print(json.dumps({"value": float(value), "grad": grad.tolist(),
                  "captured": dict(counters["stats"]).get("calls_captured", 0)}))
"""


@pytest.mark.slow
def test_the_key_changes_with_a_closed_over_value_and_with_the_source_of_a_users_module(tmp_path):
    """A step closes over a value and calls a function of the user's own module (a file outside
    installed packages). The same value and source load the saved step; another value, or an
    edited module, is another key: traced and saved again, with its own result."""
    module = tmp_path / "code" / "user_objective.py"
    module.parent.mkdir()
    script = f"import sys; sys.path.insert(0, {str(module.parent)!r})\n" + KEYED_STEP
    cache = tmp_path / "cache"

    def run(weight: str, power: int) -> dict:
        module.write_text(f"def objective(w):\n    return (w ** {power}).sum()\n")
        return _run(script, cache, weight)[0]

    first = run("1.0", 2)
    assert first["captured"] > 0 and first["grad"] == [0.0, 2.0, 4.0, 6.0]
    again = run("1.0", 2)
    assert again["captured"] == 0 and again == {**first, "captured": 0}
    reweighted = run("2.0", 2)
    assert reweighted["captured"] > 0 and reweighted["grad"] == [0.0, 4.0, 8.0, 12.0]
    edited = run("1.0", 3)
    assert edited["captured"] > 0 and edited["grad"] == [0.0, 3.0, 12.0, 27.0]
    assert len(list((cache / "lmfunc_steps").glob("*.bin"))) == 3


def _square_step(directory):
    return precompiled_step(value_and_grad(lambda w: (w ** 2).sum()), directory=directory)


def test_a_damaged_saved_step_is_compiled_again_and_replaced(tmp_path):
    """A file that does not load (truncated by a crash, say) is reported with its path, the step is
    compiled and saved again, and the next process, or the next step built here, loads it."""
    w = torch.arange(3.0)
    _square_step(tmp_path)(w)
    (saved,) = tmp_path.glob("*.bin")
    saved.write_bytes(saved.read_bytes()[:100])
    with pytest.warns(UserWarning, match=f"{saved}.*could not be loaded"):
        value, grad = _square_step(tmp_path)(w)
    assert float(value) == 5.0 and grad.tolist() == [0.0, 2.0, 4.0]
    assert saved.stat().st_size > 100
    value, grad = _square_step(tmp_path)(w)
    assert float(value) == 5.0 and grad.tolist() == [0.0, 2.0, 4.0]


def test_arguments_the_guards_refuse_run_through_the_ordinary_compile(tmp_path):
    """Other shapes than the first call's: the saved step's guards refuse them, a warning says so,
    and the ordinary compiled step computes that call and the later ones."""
    step = _square_step(tmp_path)
    assert step(torch.arange(3.0))[1].tolist() == [0.0, 2.0, 4.0]
    with pytest.warns(UserWarning, match="guards refuse"):
        value, grad = step(torch.arange(5.0))
    assert float(value) == 30.0 and grad.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert step(torch.arange(3.0))[1].tolist() == [0.0, 2.0, 4.0]


def test_a_step_whose_closure_cannot_be_serialised_compiles_the_ordinary_way(tmp_path):
    """An object torch's pickler refuses (an ``nn.Module`` in the closure) leaves no key: the step
    says so and runs compiled as ``compile_step`` would, saving nothing."""
    scale = torch.nn.Linear(1, 1)
    with torch.no_grad():
        scale.weight.fill_(3.0)
    objective = value_and_grad(lambda w: (w * scale.weight[0, 0].detach()).sum())
    with pytest.warns(UserWarning, match="no key for the step"):
        value, grad = precompiled_step(objective, directory=tmp_path)(torch.arange(3.0))
    expected = compile_step(objective)(torch.arange(3.0))
    assert float(value) == float(expected[0]) == 9.0 and torch.equal(grad, expected[1])
    assert not list(tmp_path.glob("*.bin"))


MAIN_JOB_YAML = """
preset: tiny
model: {vocab_size: 384}
data: {seq_length: 32, split: "80,20,0"}
optim: {lr: 3e-3, min_lr: 3e-4, lr_warmup_iters: 2}
run: {micro_batch_size: 4, global_batch_size: 8, eval_interval: 3, eval_iters: 1, train_iters: 6, sample_tokens: 0}
log: {log_interval: 1, progress_bar: false}
"""


@pytest.mark.slow
def test_a_resumed_main_job_loads_its_saved_steps_and_continues_the_run_exactly(tmp_path):
    """``python -m lmfunc.train`` precompiles by default: a job stopped at step 3 saves its train and
    eval steps; resumed, it saves none (both are loaded), and its losses are those of one
    uninterrupted run compiled the ordinary way, bit for bit."""
    from lmfunc.train.log import read_log

    config = tmp_path / "job.yaml"
    config.write_text(MAIN_JOB_YAML)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    saved = tmp_path / "cache" / "lmfunc_steps"

    def job(name: str, *flags: str) -> dict[int, float]:
        done = subprocess.run([sys.executable, "-m", "lmfunc.train", "--config", str(config), "--run.out-dir",
                               str(tmp_path / "runs"), "--run.name", name, *flags], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "precompiled step" not in done.stderr
        records = read_log(str(tmp_path / "runs" / name / "log.jsonl"))
        return {r["step"]: r["loss"] for r in records if r["kind"] in ("train", "valid")}

    whole = job("whole", "--run.no-precompile")
    assert not saved.exists()
    job("parts", "--run.exit-interval", "3")
    files = sorted(saved.glob("*.bin"))
    assert len(files) == 2
    parts = job("parts")
    assert sorted(saved.glob("*.bin")) == files
    assert parts == whole and sorted(whole) == [0, 1, 2, 3, 4, 5, 6]
