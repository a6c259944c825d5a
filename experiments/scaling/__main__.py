"""Study: weak scaling of the data- and tensor-parallel layouts on this box, with lmfunc's
collective bucketing and overlap and without it.

Every run does the same work per rank (4 sequences per rank per step for the data-parallel
layouts; the tensor-parallel ones split one rank's 4 sequences over 2 ranks), one thread per rank.
Reported per run: tokens/s per rank over the steps after the first log interval (the compile),
the weak-scaling efficiency (tokens/s per rank / the single process's), and from rank 0's
profile of three steps: collectives per step, the milliseconds per step the main thread spends
issuing collectives and waiting for them (the exposed communication), and that share of the step.
``python -m experiments.scaling [--quick]``; run it with nothing else on the machine. Rank 0's
Chrome traces are kept in ``results/traces/NAME.json.gz``.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

from experiments.harness import (
    Options, Run, conclude, load_results, markdown_table, parse_options, run_training, series, write_json,
)

HERE = Path(__file__).resolve().parent
NO_BUCKETS = ("--parallel.no-bucket-collectives",)
LAYOUTS = {
    "dp_shard2": ("--parallel.dp-shard", "2"),
    "dp_replicate2": ("--parallel.dp-replicate", "2"),
    "tp2_sp": ("--parallel.tp", "2", "--model.sequence-parallel"),
}
RUNS = [Run("single")] + [Run(f"{name}{suffix}", flags + extra, nproc=2) for name, flags in LAYOUTS.items()
                          for suffix, extra in (("", ()), ("_per_leaf", NO_BUCKETS))]
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def profile_summary(trace: Path) -> dict:
    """From a Chrome trace of N steps: mean step ms (the compiled graph's calls), collectives per
    step by kind, and the main thread's ms per step in collective calls and waits."""
    events = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("## Call CompiledFxGraph")]
    main = Counter(e["tid"] for e in steps).most_common(1)[0][0]
    mine = [e for e in events if e["tid"] == main and e["name"].startswith("_c10d_functional::")]
    kinds = Counter(e["name"].split("::", 1)[1].removesuffix("_out").rstrip("_") for e in mine)
    n = len(steps)
    exposed = sum(e["dur"] for e in mine) / 1e3 / n
    step_ms = sum(e["dur"] for e in steps) / 1e3 / n
    return {"step_ms": step_ms, "collectives": {k: kinds.get(k, 0) / n for k in COLLECTIVES},
            "exposed_ms": exposed, "exposed_share": exposed / step_ms}


def rows(options: Options, results: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for run in RUNS:
        steps, rates = series(results[run.name], "train", "tokens_per_s")
        steady = rates[1:] or rates
        per_rank = sum(steady) / len(steady) / run.nproc
        traces = sorted((options.out / "runs" / run.name / "profile").glob("rank0_*.json"))
        kept = options.results / "traces" / f"{run.name}.json.gz"
        if traces:  # the run's own trace, kept gzipped with the results (ui.perfetto.dev opens it)
            kept.parent.mkdir(parents=True, exist_ok=True)
            with open(traces[0], "rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
        profile = profile_summary(kept) if kept.exists() else {}
        out[run.name] = {"ranks": run.nproc, "tokens_per_s_per_rank": per_rank, **profile}
    single = out["single"]["tokens_per_s_per_rank"]
    for row in out.values():
        row["efficiency"] = row["tokens_per_s_per_rank"] / single
    return out


def main(argv=None) -> None:
    options: Options = parse_options("scaling", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    if options.report_only:
        seconds = json.loads((options.results / "summary.json").read_text())["seconds"]
    else:
        seconds = {run.name: run_training(run, config, options)["seconds"] for run in RUNS}
    table_rows = rows(options, load_results(options, [run.name for run in RUNS]))
    write_json(options.results / "scaling.json", table_rows)
    table = markdown_table(
        ["run", "ranks", "tokens/s per rank", "efficiency", "all-gathers / step", "reduce-scatters / step",
         "all-reduces / step", "step ms (profiled)", "exposed comm ms / step", "exposed share"],
        [[name, r["ranks"], r["tokens_per_s_per_rank"], r["efficiency"],
          *(r.get("collectives", {}).get(k) for k in COLLECTIVES), r.get("step_ms"), r.get("exposed_ms"),
          r.get("exposed_share")] for name, r in table_rows.items()])
    (options.results / "tables.md").write_text(table)
    failures = []
    for name in LAYOUTS:
        bucketed, per_leaf = table_rows[name]["collectives"], table_rows[f"{name}_per_leaf"]["collectives"]
        if sum(bucketed.values()) > sum(per_leaf.values()):
            failures.append(f"{name}: {sum(bucketed.values())} collectives per step bucketed, more than per leaf")
    conclude(options, config, seconds, failures, table, rows=table_rows)


if __name__ == "__main__":
    main()
