"""Study: weak scaling of the data- and tensor-parallel layouts on this box, with lmfunc's
collective bucketing and overlap and without it.

Every run does the same work per rank (4 sequences per rank per step for the data-parallel
layouts; the tensor-parallel ones split one rank's 4 sequences over 2 ranks), one thread per rank.
Reported per run: tokens/s per rank over the steps after the first log interval (the compile),
the weak-scaling efficiency (tokens/s per rank / the single process's), the same against as many
single processes side by side (``single_pair``, ``single_quad``: the cores and memory shared, no
communication; HSDP's 4 ranks share the 2 cores, so only this comparison means something for
it), and from rank 0's profile of three steps: collectives per step and the MiB a rank hands
them, the milliseconds per step the main thread spends issuing collectives and waiting for them
(the exposed communication), and that share of the step. The pair and gloo's own time for one
step's FSDP collectives (``experiments.scaling.gloo_cost``) bound the dp_shard=2 efficiency
(``box_bound``).
``python -m experiments.scaling [--quick]``, one thread per rank unless ``--threads`` says
otherwise (two 2-thread processes on 2 cores oversubscribe them: 10x slower); run it with nothing
else on the machine. Rank 0's Chrome traces are kept in ``results/traces/NAME.json.gz``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.bench.comm import collective_kind
from experiments.harness import (
    REPO, Options, Run, conclude, load_results, markdown_table, parse_options, run_training, series, write_json,
)
from lmfunc.config.yaml_io import load_config

HERE = Path(__file__).resolve().parent
NO_BUCKETS = ("--parallel.no-bucket-collectives",)
LAYOUTS = {
    "dp_shard2": (2, ("--parallel.dp-shard", "2")),
    "dp_replicate2": (2, ("--parallel.dp-replicate", "2")),
    "hsdp4": (4, ("--parallel.dp-replicate", "2", "--parallel.dp-shard", "2")),
    "tp2": (2, ("--parallel.tp", "2")),
    "tp2_sp": (2, ("--parallel.tp", "2", "--model.sequence-parallel")),
}
"""Layout name: (ranks, flags)."""
RUNS = [Run("single")] + [Run(f"{name}{suffix}", flags + extra, nproc=nproc) for name, (nproc, flags) in LAYOUTS.items()
                          for suffix, extra in (("", ()), ("_per_leaf", NO_BUCKETS))]
QUICK_LEAVES_OUT = ("dp_shard2_per_leaf", "dp_replicate2", "dp_replicate2_per_leaf", "hsdp4", "hsdp4_per_leaf", "tp2_per_leaf",
                    "tp2_sp", "tp2_sp_per_leaf")
"""Runs ``--quick`` (the test suite's mode) does not make: each is a compile of its own, and what
they would show is checked elsewhere. The compiled DDP and HSDP steps' bucketed collective counts
(HSDP's replicas all-reducing shards, not whole gradients) are asserted exactly in
tests/test_parallel.py, and they are far below the per-leaf counts, which the comm report's test
there asserts on every layout. The TP buckets stay in the quick mode through tp2. Without a 4-rank
run the quick mode also leaves out the four side-by-side singles (``QUAD``)."""
PAIR = [Run("single_pair_a"), Run("single_pair_b")]
"""Two single-process runs side by side: each rank's share of the box with no communication."""
QUAD = [Run(f"single_quad_{k}") for k in "abcd"]
"""Four single-process runs side by side on the 2 cores: the share of the box each of HSDP's 4
ranks has without communication (4 ranks cannot each have a core here)."""
SIDE_BY_SIDE = {2: ("single_pair", PAIR), 4: ("single_quad", QUAD)}
"""Ranks: the side-by-side runs a layout with that many ranks is compared with."""
ROUNDS = {False: 3, True: 1}
"""Rounds of (single, pair, dp_shard2) for the box's bound, full and quick: one run's timings on
this box swing by 0.1 in efficiency."""
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


def round_runs(k: int) -> dict[str, list[Run]]:
    """The runs of bound round ``k`` (round 1 is the main table's single and dp_shard2)."""
    suffix = "" if k == 1 else f"_round{k}"
    return {"single": [Run(f"single{suffix}")], "pair": [Run(f"{run.name}{suffix}") for run in PAIR],
            "dp_shard2": [Run(f"dp_shard2{suffix}", LAYOUTS["dp_shard2"][1], nproc=2)]}


def run_side_by_side(runs: list[Run], config: Path, options: Options) -> dict[str, float]:
    """Train ``runs`` at the same time; their seconds."""
    with ThreadPoolExecutor(len(runs)) as pool:
        done = list(pool.map(lambda run: run_training(run, config, options), runs))
    return {result["name"]: result["seconds"] for result in done}


def measure_gloo_cost(config: Path, options: Options) -> dict:
    """``experiments.scaling.gloo_cost`` on 2 ranks: the bucketed FSDP collectives of one step
    timed alone (results/gloo_cost.json)."""
    out = options.results / "gloo_cost.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "experiments.scaling.gloo_cost", str(config), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "PYTHONPATH": str(REPO)}
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


def box_bound(results: dict[str, list[dict]], k: int, gloo: dict, tokens_per_step: int) -> dict[str, float]:
    """The dp_shard=2 efficiency this box allows, from round ``k``: one process's step time ``t1``;
    two independent processes' step time ``t_pair`` (cores and memory shared, no communication);
    gloo's CPU time ``c`` for the step's bucketed collectives as lmfunc issues them (all-gathers,
    and all-to-alls with a sum for the reduce-scatters). With both cores computing, no core is free
    to run gloo's copies and reductions, so the step takes at least ``t_pair + c`` and the
    efficiency is at most ``t1 / (t_pair + c)``."""
    runs = round_runs(k)
    step_ms = {what: sum(tokens_per_step / steady_rate(results[run.name]) * run.nproc * 1e3 for run in group) / len(group)
               for what, group in runs.items()}
    t1, t_pair, t_shard = step_ms["single"], step_ms["pair"], step_ms["dp_shard2"]
    c = gloo["step"]["all_gather_ms"] + gloo["step"]["all_to_all_sum_ms"]
    return {"single_step_ms": t1, "pair_step_ms": t_pair, "gloo_fsdp_ms": c, "pair_efficiency": t1 / t_pair,
            "bound": t1 / (t_pair + c), "dp_shard2_step_ms": t_shard, "dp_shard2_efficiency": t1 / t_shard}


ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4}
"""Bytes per element of the profiler's ``Input type`` names."""


def input_mib(event: dict) -> float:
    """MiB of a profiled op's first input (its ``Input Dims`` and ``Input type``): what a rank
    hands to a collective (an all-gather's shard, a reduction's whole tensor)."""
    dims, types = event.get("args", {}).get("Input Dims") or [[]], event.get("args", {}).get("Input type") or [""]
    return math.prod(dims[0]) * ELEMENT_BYTES.get(types[0], 0) / 2**20 if dims[0] else 0.0


def profile_summary(trace: Path) -> dict:
    """From a Chrome trace of N steps: mean step ms (the compiled graph's calls), collectives per
    step by kind and the MiB each rank hands them, and the main thread's ms per step in
    collective calls and waits."""
    events = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("## Call CompiledFxGraph")]
    main = Counter(e["tid"] for e in steps).most_common(1)[0][0]
    mine = [e for e in events if e["tid"] == main and e["name"].startswith("_c10d_functional::")]
    kinds, mib = Counter(), Counter()
    for e in mine:
        kind = collective_kind(e["name"])
        kinds[kind] += 1
        mib[kind] += input_mib(e)
    n = len(steps)
    exposed = sum(e["dur"] for e in mine) / 1e3 / n
    step_ms = sum(e["dur"] for e in steps) / 1e3 / n
    return {"step_ms": step_ms, "collectives": {k: kinds.get(k, 0) / n for k in COLLECTIVES},
            "mib": {k: mib.get(k, 0.0) / n for k in COLLECTIVES}, "exposed_ms": exposed,
            "exposed_share": exposed / step_ms}


def steady_rate(records: list[dict]) -> float:
    """Mean logged tokens/s after the first log interval (the compile)."""
    rates = series(records, "train", "tokens_per_s")[1]
    steady = rates[1:] or rates
    return sum(steady) / len(steady)


def study_runs(quick: bool) -> list[Run]:
    """The main table's runs: ``RUNS``, less ``QUICK_LEAVES_OUT`` in the quick mode."""
    return [run for run in RUNS if not (quick and run.name in QUICK_LEAVES_OUT)]


def side_by_side_runs(quick: bool) -> dict[int, tuple[str, list[Run]]]:
    """``SIDE_BY_SIDE`` for the ranks the mode's runs have: no ``QUAD`` in the quick mode."""
    ranks = {run.nproc for run in study_runs(quick)}
    return {n: group for n, group in SIDE_BY_SIDE.items() if n in ranks}


def rows(options: Options, results: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for run in study_runs(options.quick):
        per_rank = steady_rate(results[run.name]) / run.nproc
        traces = sorted((options.out / "runs" / run.name / "profile").glob("rank0_*.json"))
        kept = options.results / "traces" / f"{run.name}.json.gz"
        if traces:  # the run's own trace, kept gzipped with the results (ui.perfetto.dev opens it)
            kept.parent.mkdir(parents=True, exist_ok=True)
            with open(traces[0], "rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
        profile = profile_summary(kept) if kept.exists() else {}
        out[run.name] = {"ranks": run.nproc, "tokens_per_s_per_rank": per_rank, **profile}
        if run.name == "single":
            for ranks, (name, group) in side_by_side_runs(options.quick).items():
                rates = [steady_rate(results[r.name]) for r in group]
                out[name] = {"ranks": ranks, "tokens_per_s_per_rank": sum(rates) / len(rates)}
    single = out["single"]["tokens_per_s_per_rank"]
    for row in out.values():
        row["efficiency"] = row["tokens_per_s_per_rank"] / single
        side_by_side = SIDE_BY_SIDE.get(row["ranks"], ("single",))[0]
        row["vs_side_by_side"] = row["tokens_per_s_per_rank"] / out[side_by_side]["tokens_per_s_per_rank"]
    return out


def main(argv=None) -> None:
    options: Options = parse_options("scaling", __doc__.splitlines()[0], argv, threads=1)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    rounds = ROUNDS[options.quick]
    if options.report_only:
        seconds = json.loads((options.results / "summary.json").read_text())["seconds"]
    else:
        seconds = {run.name: run_training(run, config, options)["seconds"] for run in study_runs(options.quick)}
        seconds |= run_side_by_side(round_runs(1)["pair"], config, options)
        if 4 in side_by_side_runs(options.quick):
            seconds |= run_side_by_side(QUAD, config, options)
        for k in range(2, rounds + 1):
            for group in round_runs(k).values():
                seconds |= run_side_by_side(group, config, options)
        measure_gloo_cost(config, options)
    bound_names = [run.name for k in range(1, rounds + 1) for group in round_runs(k).values() for run in group]
    quad = QUAD if 4 in side_by_side_runs(options.quick) else []
    results = load_results(options, dict.fromkeys([run.name for run in study_runs(options.quick) + quad] + bound_names))
    table_rows = rows(options, results)
    write_json(options.results / "scaling.json", table_rows)
    model_cfg = load_config(str(config))
    gloo = json.loads((options.results / "gloo_cost.json").read_text())
    tokens_per_step = model_cfg.run.micro_batch_size * model_cfg.data.seq_length
    bounds = [box_bound(results, k, gloo, tokens_per_step) for k in range(1, rounds + 1)]
    bound = {key: statistics.median(b[key] for b in bounds) for key in bounds[0]}
    table = markdown_table(
        ["run", "ranks", "tokens/s per rank", "efficiency", "vs side by side", "all-gathers / step", "reduce-scatters / step",
         "all-reduces / step", "all-to-alls / step", "collective MiB / step", "step ms (profiled)", "exposed comm ms / step", "exposed share"],
        [[name, r["ranks"], r["tokens_per_s_per_rank"], r["efficiency"], r["vs_side_by_side"],
          *(r.get("collectives", {}).get(k) for k in COLLECTIVES),
          sum(r["mib"].values()) if "mib" in r else None, r.get("step_ms"), r.get("exposed_ms"),
          r.get("exposed_share")] for name, r in table_rows.items()])
    table += "\n\n" + markdown_table(["round", *bound], [[k, *b.values()] for k, b in enumerate(bounds, 1)]
                                       + [["median", *bound.values()]]) + "\n"
    (options.results / "tables.md").write_text(table)
    failures = []
    for name in LAYOUTS:
        if f"{name}_per_leaf" not in table_rows or name not in table_rows:
            continue
        bucketed, per_leaf = table_rows[name]["collectives"], table_rows[f"{name}_per_leaf"]["collectives"]
        if sum(bucketed.values()) > sum(per_leaf.values()):
            failures.append(f"{name}: {sum(bucketed.values())} collectives per step bucketed, more than per leaf")
    conclude(options, config, seconds, failures, table, rows=table_rows, bound=bound, bound_rounds=bounds)


if __name__ == "__main__":
    main()
