"""Study 4: one training run, six parallel layouts, the same losses.

``python -m lmfunc.train`` on 1 process and under torchrun on dp_shard=2 (FSDP), dp_replicate=2
(DDP), tp=2, tp=2 with sequence parallelism, and dp_shard=2 x tp=2 + SP (4 ranks); same config,
seed and global batch. Reports the largest |train loss - single process's| over every step and
the same for the validation losses. ``python -m experiments.invariance [--quick]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.harness import (
    Options, Run, conclude, load_results, markdown_table, parse_options, pyplot, run_colors, run_training,
    save_figure, series,
)

HERE = Path(__file__).resolve().parent
SP = "--model.sequence-parallel"
RUNS = [
    Run("single"),
    Run("dp_shard2", ("--parallel.dp-shard", "2"), nproc=2),
    Run("dp_replicate2", ("--parallel.dp-replicate", "2"), nproc=2),
    Run("tp2", ("--parallel.tp", "2"), nproc=2),
    Run("tp2_sp", ("--parallel.tp", "2", SP), nproc=2),
    Run("dp_shard2_tp2_sp", ("--parallel.dp-shard", "2", "--parallel.tp", "2", SP), nproc=4),
]
TOLERANCE = 1e-4  # the invariance promise: |Δloss| below this at every step, fp32


def max_deltas(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per layout: the largest |Δ| against the single process over the train losses (every step)
    and the validation losses, and how many steps were compared."""
    rows = {}
    for kind in ("train", "valid"):
        ref = dict(zip(*series(results["single"], kind, "loss")))
        for name, records in results.items():
            steps, losses = series(records, kind, "loss")
            if [s for s in steps] != sorted(ref):
                raise SystemExit(f"{name}: logged {kind} steps {steps[:5]}... differ from the single process's")
            deltas = [abs(loss - ref[step]) for step, loss in zip(steps, losses)]
            rows.setdefault(name, {})[f"max_{kind}_delta"] = max(deltas)
            rows[name][f"{kind}_points"] = len(deltas)
    return rows


def report(results: dict[str, list[dict]], rows: dict, out: Path) -> str:
    plt = pyplot()
    colors = run_colors(list(results))
    fig, (ax_loss, ax_delta) = plt.subplots(1, 2, figsize=(12, 4.5))
    ref_steps, ref = series(results["single"], "train", "loss")
    styles = ["-", "--", ":", "-.", (0, (3, 1, 1, 1)), (0, (5, 2))]
    for (name, records), style in zip(results.items(), styles):
        steps, losses = series(records, "train", "loss")
        ax_loss.plot(steps, losses, linestyle=style, label=name, linewidth=1.5, color=colors[name])
        if name != "single":
            ax_delta.plot(steps, [max(abs(a - b), 1e-9) for a, b in zip(losses, ref)], label=name, linewidth=1,
                          color=colors[name])
    ax_loss.set(xlabel="step", ylabel="train loss", title="six layouts, one curve")
    ax_delta.axhline(TOLERANCE, color="red", linewidth=0.8, label=f"promise: {TOLERANCE:g}")
    ax_delta.set(xlabel="step", ylabel="|loss - single process| (log; 1e-9 = equal)", yscale="log",
                 title="difference from one process")
    ax_loss.legend(fontsize=8)
    ax_delta.legend(fontsize=7)
    save_figure(fig, out / "invariance.png")
    table = markdown_table(
        ["layout", "processes", "steps compared", "max abs Δ train loss", "max abs Δ val loss"],
        [[run.name, run.nproc, rows[run.name]["train_points"], rows[run.name]["max_train_delta"],
          rows[run.name]["max_valid_delta"]] for run in RUNS],
    )
    (out / "results" / "tables.md").write_text(table)
    return table


def main(argv=None) -> None:
    options: Options = parse_options("invariance", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    if options.report_only:
        seconds = json.loads((options.results / "summary.json").read_text())["seconds"]
    else:
        seconds = {run.name: run_training(run, config, options)["seconds"] for run in RUNS}
    results = load_results(options, [run.name for run in RUNS])
    rows = max_deltas(results)
    failures = [f"{name}: max |Δloss| {max(r['max_train_delta'], r['max_valid_delta']):.3g} >= {TOLERANCE}"
                for name, r in rows.items() if max(r["max_train_delta"], r["max_valid_delta"]) >= TOLERANCE]
    tables = report(results, rows, options.out)
    conclude(options, config, seconds, failures, tables, layouts=rows)


if __name__ == "__main__":
    main()
