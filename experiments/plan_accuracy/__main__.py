"""Study 5: lmfunc.plan's predicted step memory against the measured one, on the CPU.

For each case of config.yaml, a fresh process builds the run's state and compiled train step
exactly as ``python -m lmfunc.train`` does (same optimizer, loss scaling, donation), trains two
steps, then measures the third: the bytes its state and batch hold, plus the peak the allocator
reaches during the step (``lmfunc.metrics.allocator_peak_bytes``: the profiler's memory events,
the CPU's equivalent of ``torch.cuda.max_memory_allocated``). The prediction is
``lmfunc.plan.memory.predict_memory``; the invariant is |predicted / measured - 1| <= 15%.
``python -m experiments.plan_accuracy [--quick]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.harness import (
    REPO, Options, conclude, markdown_table, parse_options, pyplot, save_figure, write_json,
)

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.15
MiB = 2**20


def case_configs(config: Path) -> dict:
    """Case name -> validated ``TrainConfig`` of the study's YAML."""
    from lmfunc.config.yaml_io import read_yaml, train_config_from_dict

    cases = read_yaml(str(config))["cases"]
    return {name: train_config_from_dict(spec or {}, source=f"{config.name}: cases.{name}").validate(1)
            for name, spec in cases.items()}


def measure(cfg) -> dict:
    """Build and run ``cfg``'s compiled train step (three steps) in this process; the third step's
    memory: the bytes held before it (state and batch) and the allocator's peak above them."""
    import torch

    from lmfunc.metrics import allocator_peak_bytes
    from lmfunc.precision import compute_dtype
    from lmfunc.train.batch_plan import BatchPlan
    from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
    from lmfunc.train.params import init_params
    from lmfunc.train.state import TrainState
    from lmfunc.train.step import make_train_step
    from lmfunc.tree import tree_bytes

    plan = BatchPlan.from_config(cfg.run, 1)
    schedule = build_lr_schedule(cfg, plan, cfg.run.train_iters)
    params = init_params(cfg.model, None, seed=cfg.run.seed)
    tx = build_optimizer(cfg, schedule, params)
    state = TrainState.create(params, tx, seed=cfg.run.seed, loss_scale=cfg.precision.loss_scaling())
    step = make_train_step(cfg.model, tx, clip_grad=cfg.optim.clip_grad, lr_schedule=schedule,
                           compute_dtype=compute_dtype(cfg.precision.compute_dtype),
                           loss_scale=cfg.precision.loss_scaling(), compile=True, donate_state=True)
    microbatches = cfg.run.global_batch_size // cfg.run.micro_batch_size
    tokens = torch.randint(0, 256, (microbatches, cfg.run.micro_batch_size, cfg.data.seq_length),
                           generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens, "labels": tokens.roll(-1, dims=-1)}
    for _ in range(2):
        state, _ = step(state, batch)
    held = tree_bytes(state) + tree_bytes(batch)
    (state, _), peak = allocator_peak_bytes(lambda: step(state, batch))
    return {"held_bytes": held, "step_peak_bytes": peak, "measured_bytes": held + peak,
            "params": sum(p.numel() for p in torch.utils._pytree.tree_leaves(state.params))}


def run_case(name: str, config: Path, options: Options) -> dict:
    """``measure`` of one case in a fresh process (its own compile and allocator history)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads)}
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "experiments.plan_accuracy", "--case", name, "--config", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


def report(cases: dict, results: dict[str, dict], options: Options) -> tuple[str, list[str], dict]:
    """The table (``tables.md``), the figure (``plan_accuracy.png``), the failed invariants and
    the per-case numbers."""
    from lmfunc.plan import make_plan

    rows, failures, numbers = [], [], {}
    for name, cfg in cases.items():
        plan = make_plan(cfg, 1)
        predicted, measured = plan.lmfunc.peak, results[name]["measured_bytes"]
        error = predicted / measured - 1
        numbers[name] = {"predicted_mib": predicted / MiB, "measured_mib": measured / MiB, "error": error}
        m = cfg.model
        rows.append([name, f"h {m.hidden_size}, L {m.num_layers}" + (", scan" if m.scan_layers else ""), m.recompute_granularity,
                     cfg.precision.compute_dtype, f"{cfg.run.micro_batch_size} x {cfg.data.seq_length}",
                     round(measured / MiB, 1), round(predicted / MiB, 1), f"{100 * error:+.1f}%",
                     round(plan.megatron.weight_and_optimizer / MiB + plan.megatron.activations / MiB, 1)])
        if abs(error) > TOLERANCE:
            failures.append(f"{name}: predicted {predicted / MiB:.1f} MiB vs measured {measured / MiB:.1f} MiB "
                            f"({100 * error:+.1f}%, limit {100 * TOLERANCE:.0f}%)")
    table = markdown_table(["case", "model", "recompute", "compute", "micro batch x seq", "measured MiB",
                            "lmfunc.plan MiB", "error", "Megatron's formula MiB"], rows)
    (options.results / "tables.md").write_text(table)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(numbers)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [numbers[n]["measured_mib"] for n in names], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [numbers[n]["predicted_mib"] for n in names], width=0.4, label="lmfunc.plan")
    ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax.set(ylabel="peak step memory (MiB)", title="predicted against measured, one CPU process")
    ax.legend()
    save_figure(fig, options.out / "plan_accuracy.png")
    return table, failures, numbers


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--case" in argv:
        name, config = argv[argv.index("--case") + 1], Path(argv[argv.index("--config") + 1])
        print(json.dumps(measure(case_configs(config)[name])))
        return
    options = parse_options("plan_accuracy", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    cases = case_configs(config)
    path = options.results / "measured.json"
    if options.report_only:
        results = json.loads(path.read_text())
    else:
        results = {name: run_case(name, config, options) for name in cases}
        write_json(path, results)
    table, failures, numbers = report(cases, results, options)
    conclude(options, config, {name: r["seconds"] for name, r in results.items()}, failures, table, cases=numbers)


if __name__ == "__main__":
    main()
