"""The train-step benchmark's workload and its paired timing (``experiments.bench.workload``, ``experiments.bench.paired``)."""

import gc
import itertools
import json
import math
import statistics
import weakref

import pytest
import torch

from experiments.bench import compile_phases
from experiments.bench.config import BenchConfig
from experiments.bench.paired import paired_summary, round_orders, run_paired_worker, time_in_turn
from experiments.bench.train_step import main
from experiments.bench.workload import model_config, module_step
from lmfunc import model
from lmfunc.tree import tree_leaves

SMALL = dict(layers=1, heads=2, hidden=32, seq=16, vocab=64, batch=2, warmup=0)


def test_module_baseline_does_not_keep_the_initial_weights():
    """The baseline copies the weights into its module; the caller's tree must be freeable, or the
    module's peak memory carries a dead copy of the parameters (it did: 15.5 MiB on the bench's
    workload, through a closure of the module class)."""
    cfg = model_config(BenchConfig(**SMALL))
    params = model.init(cfg, seed=0)
    refs = [weakref.ref(leaf) for leaf in tree_leaves(params)]
    step = module_step(cfg, params, compiled=False)
    del params
    gc.collect()
    assert [ref() for ref in refs if ref() is not None] == []
    tokens = torch.zeros(2, 16, dtype=torch.long)
    assert float(step(tokens, tokens)) > 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_round_orders_balance_positions_and_predecessors(n):
    """Over n! rounds (twice through: 2 n! rounds) every variant holds every position 2 (n-1)!
    times and directly follows every other variant 2 (n-1)! times."""
    names = [f"v{i}" for i in range(n)]
    orders = round_orders(names, 2 * math.factorial(n))
    assert all(sorted(order) == names for order in orders)
    expected = 2 * math.factorial(n - 1)
    for name, position in itertools.product(names, range(n)):
        assert sum(order[position] == name for order in orders) == expected
    pairs = [pair for order in orders for pair in zip(order, order[1:])]
    assert {pair: pairs.count(pair) for pair in itertools.permutations(names, 2)} == dict.fromkeys(
        itertools.permutations(names, 2), expected)


def test_time_in_turn_times_each_step_once_per_round():
    now = [0.0]
    calls = []
    cost = {"a": 1.0, "b": 3.0, "c": 2.0}

    def make(name):
        def step():
            calls.append(name)
            now[0] += cost[name]
            return name

        return step

    waited = []
    times = time_in_turn({name: make(name) for name in cost}, rounds=6, wait=waited.append, clock=lambda: now[0])
    assert times == {name: [c] * 6 for name, c in cost.items()}
    assert calls == [name for order in round_orders(list(cost), 6) for name in order]
    assert waited == calls


def test_paired_summary_ratios_quartiles_and_wins():
    times = {"func": [0.9, 1.0, 1.2, 0.8, 1.0], "module": [1.0, 1.0, 1.0, 1.0, 1.0]}
    summary = paired_summary(times, "module")
    func = summary["func"]
    assert func["median_s"] == pytest.approx(1.0)
    assert func["ratio_median"] == pytest.approx(1.0)
    assert (func["ratio_q25"], func["ratio_q75"]) == (pytest.approx(0.9), pytest.approx(1.0))
    assert (func["faster_rounds"], func["rounds"]) == (2, 5)
    assert summary["module"]["ratio_median"] == 1.0 and summary["module"]["faster_rounds"] == 0
    with pytest.raises(ValueError, match="reference variant 'other'"):
        paired_summary(times, "other")
    with pytest.raises(ValueError, match="same number"):
        paired_summary({"func": [1.0], "module": [1.0, 1.0]}, "module")


def test_paired_worker_starts_every_variant_from_the_same_weights():
    result = run_paired_worker(BenchConfig(worker="paired", variants=("func-eager", "module-eager"), steps=2, **SMALL))
    assert result["first_loss"]["func-eager"] == pytest.approx(result["first_loss"]["module-eager"], abs=1e-5)
    assert [len(t) for t in result["times"].values()] == [2, 2]
    assert all(t > 0 for ts in result["times"].values() for t in ts)


def test_bf16_variants_compute_in_bf16_from_the_same_weights():
    """``--dtype bf16``: lmfunc's step (``compute_dtype``) and the module's (autocast) start from the
    same fp32 weights, so their first losses agree to bf16's rounding and differ from fp32's."""
    fp32 = run_paired_worker(BenchConfig(worker="paired", variants=("func-eager", "module-eager"), steps=1, **SMALL))
    bf16 = run_paired_worker(BenchConfig(worker="paired", variants=("func-eager", "module-eager"), steps=1,
                                         dtype="bf16", **SMALL))
    assert bf16["first_loss"]["func-eager"] == pytest.approx(bf16["first_loss"]["module-eager"], abs=2e-2)
    assert bf16["first_loss"]["func-eager"] != fp32["first_loss"]["func-eager"]
    assert bf16["first_loss"]["module-eager"] != fp32["first_loss"]["module-eager"]
    with pytest.raises(SystemExit, match="--dtype 'fp16'"):
        main(BenchConfig(dtype="fp16", variants=("func-eager",), **SMALL))


def test_paired_cli_prints_each_variant_against_the_last(capsys):
    main(BenchConfig(paired=True, variants=("func-eager", "module-eager"), steps=2, repeats=1, **SMALL))
    out = capsys.readouterr().out
    assert "paired: 1 process(es) x 2 rounds (one step of each variant per round" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("func-eager", "module-eager"))}
    assert rows["module-eager"][4] == "1.0000" and rows["module-eager"][-2].startswith("0/2")
    assert "  func-eager per process: ms/step " in out
    assert float(rows["func-eager"][-1]) == pytest.approx(float(rows["module-eager"][-1]), abs=1e-4)
    with pytest.raises(SystemExit, match="two or more --variants"):
        main(BenchConfig(paired=True, variants=("func-eager",), **SMALL))


def test_cli_reports_every_repeat_and_writes_them_to_json(capsys, tmp_path):
    """Each repeat's peak RSS and step memory are printed and kept in ``--json-out`` next to the
    medians: differences of a MiB between variants only mean something against the spread."""
    out_file = tmp_path / "bench.json"
    main(BenchConfig(variants=("func-eager",), steps=1, repeats=2, json_out=str(out_file), **SMALL))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  repeat ")]
    assert [line.split()[1] for line in lines] == ["1", "2"]
    assert all(" peak " in line and " MiB  step mem " in line for line in lines)
    saved = json.loads(out_file.read_text())
    runs = saved["runs"]["func-eager"]
    assert len(runs) == 2 and all(run["peak_mib"] > 0 and run["first_loss"] > 0 for run in runs)
    assert saved["results"]["func-eager"]["peak_mib"] == pytest.approx(statistics.median(run["peak_mib"] for run in runs))


@pytest.mark.parametrize("memory_mode, keep, kept", [(False, True, True), (True, True, False), (False, False, False)])
def test_workers_keep_freed_host_memory_as_the_main_job_does(monkeypatch, capsys, memory_mode, keep, kept):
    """A worker keeps freed host memory (``run.keep_host_memory``'s default) unless told not to, or
    in memory mode, whose RSS must follow live memory; ``_spawn`` hands both settings on."""
    from experiments.bench import train_step

    calls, spawned = [], []
    monkeypatch.setattr("lmfunc.train.host_memory.keep_freed_host_memory", lambda *args: calls.append(args))
    monkeypatch.setattr(train_step, "run_worker", lambda bc: {"variant": bc.worker})
    main(BenchConfig(worker="func-eager", memory_mode=memory_mode, keep_host_memory=keep, **SMALL))
    assert json.loads(capsys.readouterr().out) == {"variant": "func-eager"} and bool(calls) == kept

    def run(args, env, **kwargs):
        spawned.append((args, env))
        return type("Done", (), {"returncode": 0, "stdout": "{}\n", "stderr": ""})()

    monkeypatch.setattr(train_step.subprocess, "run", run)
    train_step._spawn(BenchConfig(memory_mode=memory_mode, keep_host_memory=keep, **SMALL), "func-eager")
    (args, env), = spawned
    assert ("--memory-mode" in args) == memory_mode and ("MALLOC_MMAP_THRESHOLD_" in env) == memory_mode
    assert ("--no-keep-host-memory" in args) == (not keep)


def test_compile_phases_add_up_to_the_compile_time_and_nested_ones_are_not_counted_twice():
    timers = {"bytecode_tracing": 3.0, "GraphLowering.run": 2.0, "Scheduler.codegen": 4.0, "async_compile.wait": 6.0,
              "_recursive_post_grad_passes": 1.5, "pass.post_grad_passes.post_grad_custom_pre_pass": 0.5,
              "compile_fx_inner": 99.0}
    phases = compile_phases.phase_seconds(timers, compile_s=20.0)
    assert phases["Dynamo: bytecode tracing"] == 3.0 and phases["AOTAutograd: joint forward-backward trace"] == 0.0
    lmfunc_passes = next(name for name in phases if name.startswith("  of which lmfunc"))
    assert phases[lmfunc_passes] == 0.5
    assert phases["other (Python between the phases, imports, first run)"] == pytest.approx(20.0 - 16.5)
    runs = {"func-compiled": [{"timers": timers, "compile_s": 20.0, "kernels": 28},
                              {"timers": {**timers, "bytecode_tracing": 5.0}, "compile_s": 22.0, "kernels": 28}],
            "func-eager": [{"compile_s": 0.0}]}
    table = compile_phases.phase_table(runs).splitlines()
    assert table[0] == "| phase | func-compiled |"
    assert "| Dynamo: bytecode tracing | 4.0 |" in table and table[-1] == "| C++ libraries built (GCC runs) | 28 |"
    assert "| **compile (first step - steady step)** | **21.0** |" in table
