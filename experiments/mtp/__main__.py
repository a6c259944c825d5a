"""Study 2: does multi-token prediction help the main head at this scale, and what does it cost?

MTP depth 0 (none), 1, 2 and 3 with λ (``model.mtp_loss_scaling_factor``) 0.1 and 0.3 on the
default model. Reports the main head's validation loss against steps and against training
time, the per-depth MTP losses, tokens/s and peak memory.
``python -m experiments.mtp [--quick]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.harness import (
    Options, Run, conclude, last, load_results, markdown_table, parse_options, pyplot, run_colors,
    run_training, save_figure,
    series,
)
from lmfunc.config.yaml_io import load_config

HERE = Path(__file__).resolve().parent


def mtp_run(depth: int, factor: float = 0.1) -> Run:
    if depth == 0:
        return Run("depth0")
    return Run(f"depth{depth}_lambda{factor:g}", ("--model.mtp-num-layers", str(depth),
                                                 "--model.mtp-loss-scaling-factor", str(factor)))


RUNS = [mtp_run(0), *[mtp_run(d, 0.1) for d in (1, 2, 3)], *[mtp_run(d, 0.3) for d in (1, 3)]]
QUICK_RUNS = ("depth0", "depth1_lambda0.1", "depth2_lambda0.3")
QUICK_EXTRA = [mtp_run(2, 0.3)]


def summarise(results: dict[str, list[dict]], tokens_per_step: int) -> dict[str, dict]:
    """Per run: final main-head validation loss and its difference from depth 0, the last MTP
    losses per depth, median tokens/s, peak RSS, training seconds per step (compile excluded)."""
    reference = last(results["depth0"], "valid", "loss")
    rows = {}
    for name, records in results.items():
        rates = sorted(r["tokens_per_s"] for r in records if r["kind"] == "train" and r.get("tokens_per_s"))
        rate = rates[len(rates) // 2] if rates else None
        depths = sorted({k for r in records for k in r if k.startswith("mtp_") and k.endswith("_loss")})
        val = last(records, "valid", "loss")
        rows[name] = {
            "final_val_loss": val,
            "delta_vs_depth0": None if val is None or reference is None else val - reference,
            "mtp_losses": {k: last(records, "train", k) for k in depths},
            "tokens_per_s": rate,
            "seconds_per_step": tokens_per_step / rate if rate else None,
            "peak_rss_mib": max((r.get("mem_peak_rss_mib", 0.0) for r in records if r["kind"] == "train"), default=None),
        }
    return rows


def check(rows: dict, initial_loss: float, timed: bool) -> list[str]:
    """Depth-k runs log k MTP losses, each finite and below the untrained model's loss (every depth
    learns); with ``timed``, MTP costs time (fewer tokens/s than depth 0). The quick mode, which
    the test suite runs beside other tests, leaves the timing out: runs made one after another on a
    shared machine do not compare."""
    failures = []
    for name, r in rows.items():
        depth = 0 if name == "depth0" else int(name[5])
        losses = [r["mtp_losses"].get(f"mtp_{k}_loss") for k in range(1, depth + 1)]
        if len(r["mtp_losses"]) != depth or any(v is None for v in losses):
            failures.append(f"{name}: logged MTP losses {sorted(r['mtp_losses'])}, expected {depth}")
        elif not all(v < initial_loss for v in losses):
            failures.append(f"{name}: MTP losses {losses} not below the untrained loss {initial_loss:.3f}")
        if (timed and depth and r["tokens_per_s"] and rows["depth0"]["tokens_per_s"]
                and r["tokens_per_s"] >= rows["depth0"]["tokens_per_s"]):
            failures.append(f"{name}: {r['tokens_per_s']:.0f} tokens/s, not slower than depth 0")
    return failures


def report(results: dict[str, list[dict]], rows: dict, out: Path) -> str:
    plt = pyplot()
    colors = run_colors(list(results))
    fig, (ax_step, ax_time, ax_mtp) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, records in results.items():
        steps, val = series(records, "valid", "loss")
        ax_step.plot(steps, val, marker="o", markersize=3, label=name, color=colors[name])
        ax_time.plot([s * rows[name]["seconds_per_step"] for s in steps], val, marker="o", markersize=3, label=name,
                     color=colors[name])
        for k, key in enumerate(sorted(rows[name]["mtp_losses"]), start=1):
            ax_mtp.plot(*series(records, "train", key), linestyle=["-", "--", ":"][k - 1], label=f"{name} depth {k}",
                        linewidth=1, color=colors[name])
    ax_step.set(xlabel="step", ylabel="main-head validation loss", title="against steps")
    ax_time.set(xlabel="training seconds (compile excluded)", ylabel="main-head validation loss",
                title="against training time")
    ax_mtp.set(xlabel="step", ylabel="MTP loss (train, last step of each interval)", title="MTP losses per depth",
               ylim=(None, 4))
    for ax in (ax_step, ax_time):
        ax.set_ylim(None, min(4.0, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
    ax_mtp.legend(fontsize=6)
    save_figure(fig, out / "mtp.png")
    table = markdown_table(
        ["run", "final val loss (main head)", "Δ vs depth 0", "MTP losses (depth 1, 2, 3)", "tokens/s",
         "s/step", "peak RSS MiB"],
        [[n, r["final_val_loss"], r["delta_vs_depth0"], ", ".join(f"{v:.3f}" for v in r["mtp_losses"].values()) or "–",
          r["tokens_per_s"], r["seconds_per_step"], r["peak_rss_mib"]] for n, r in rows.items()],
    )
    (out / "results" / "tables.md").write_text(table)
    return table


def main(argv=None) -> None:
    options: Options = parse_options("mtp", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    runs = [run for run in RUNS + QUICK_EXTRA if run.name in QUICK_RUNS] if options.quick else RUNS
    if options.report_only:
        seconds = json.loads((options.results / "summary.json").read_text())["seconds"]
    else:
        seconds = {run.name: run_training(run, config, options)["seconds"] for run in runs}
    cfg = load_config(str(config))
    results = load_results(options, [run.name for run in runs])
    rows = summarise(results, cfg.run.micro_batch_size * cfg.data.seq_length)
    failures = check(rows, series(results["depth0"], "valid", "loss")[1][0], timed=not options.quick)
    tables = report(results, rows, options.out)
    conclude(options, config, seconds, failures, tables, runs=rows)


if __name__ == "__main__":
    main()
