"""Study 6: cold compile time and step time against depth, unrolled blocks against ``scan_layers``.

Each case is the train-step benchmark's compiled lmfunc step (``experiments.bench``, variant
func-compiled: AdamW, clipping, the state donated) in a fresh process with an empty Inductor
cache (in the quick mode, one cache for its cases), at one depth, with the blocks unrolled in the step's graph or stacked and run by torch's
``scan`` (``model.scan_layers``). Compile time is the first step minus a steady one. The
invariants: the scan step's first loss equals the unrolled one's (relative 1e-5), and in the
full study the cold compile at the deepest model is at most 1.5x the shallowest's with scan.
``python -m experiments.compile_depth [--quick]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from experiments.harness import REPO, Options, conclude, markdown_table, parse_options, pyplot, save_figure, write_json

HERE = Path(__file__).resolve().parent
FULL = {"layers": (4, 8, 16, 32), "hidden": 128, "seq": 128, "batch": 4, "steps": 5}
QUICK = {"layers": (1, 2), "hidden": 64, "seq": 32, "batch": 2, "steps": 2}
MODES = ("unrolled", "scan")
COMPILE_RATIO_LIMIT = 1.5
LOSS_RTOL = 1e-5


def run_case(layers: int, mode: str, workload: dict, options: Options, cache: Optional[str] = None) -> dict:
    """One benchmark worker in a fresh process: its JSON result plus the case. Its Inductor cache is
    a fresh directory, or ``cache`` (the quick mode shares one between its cases: the CPU's ISA
    probes and the precompiled header are built once, and no compile time is asserted there)."""
    args = [sys.executable, "-m", "experiments.bench", "--worker", "func-compiled", "--layers", str(layers),
            "--hidden", str(workload["hidden"]), "--seq", str(workload["seq"]), "--batch", str(workload["batch"]),
            "--steps", str(workload["steps"]), "--warmup", "2", "--threads", str(options.threads)]
    if mode == "scan":
        args.append("--scan-layers")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as fresh:
        env = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "TORCHINDUCTOR_CACHE_DIR": cache or fresh}
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"case layers={layers} {mode} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "layers": layers, "mode": mode, "seconds": round(time.perf_counter() - began, 1)}


def report(results: list[dict], workload: dict, options: Options) -> tuple[str, list[str]]:
    """The table (``tables.md``), the figure (``compile_depth.png``) and the failed invariants."""
    by = {(r["layers"], r["mode"]): r for r in results}
    depths = sorted({r["layers"] for r in results})
    rows, failures = [], []
    for layers in depths:
        unrolled, scan = by[(layers, "unrolled")], by[(layers, "scan")]
        rows.append([layers, round(unrolled["compile_s"], 1), round(scan["compile_s"], 1),
                     round(1e3 * unrolled["step_s"], 1), round(1e3 * scan["step_s"], 1),
                     f"{scan['step_s'] / unrolled['step_s'] - 1:+.0%}", unrolled["first_loss"], scan["first_loss"]])
        if abs(scan["first_loss"] - unrolled["first_loss"]) > LOSS_RTOL * abs(unrolled["first_loss"]):
            failures.append(f"layers={layers}: scan's first loss {scan['first_loss']} differs from the unrolled "
                            f"{unrolled['first_loss']} by more than {LOSS_RTOL:g} relative")
    if not options.quick:
        ratio = by[(depths[-1], "scan")]["compile_s"] / by[(depths[0], "scan")]["compile_s"]
        if ratio > COMPILE_RATIO_LIMIT:
            failures.append(f"scan: cold compile at {depths[-1]} layers is {ratio:.2f}x the one at {depths[0]} "
                            f"(limit {COMPILE_RATIO_LIMIT}x)")
    table = markdown_table(["layers", "compile unrolled s", "compile scan s", "step unrolled ms", "step scan ms",
                            "scan step", "loss0 unrolled", "loss0 scan"], rows)
    (options.results / "tables.md").write_text(table)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        left.plot(depths, [by[(d, mode)]["compile_s"] for d in depths], marker="o", label=mode)
        right.plot(depths, [1e3 * by[(d, mode)]["step_s"] for d in depths], marker="o", label=mode)
    tokens = workload["batch"] * workload["seq"]
    left.set(xlabel="layers", ylabel="cold compile (s)", title=f"width {workload['hidden']}, {tokens} tokens")
    right.set(xlabel="layers", ylabel="steady step (ms)", title=f"{options.threads} thread(s), CPU")
    left.legend()
    right.legend()
    save_figure(fig, options.out / "compile_depth.png")
    return table, failures


def main(argv=None) -> None:
    options = parse_options("compile_depth", __doc__.splitlines()[0], argv)
    workload = QUICK if options.quick else FULL
    path = options.results / "measured.json"
    if options.report_only:
        results = json.loads(path.read_text())
    else:
        with tempfile.TemporaryDirectory() as shared:
            cache = shared if options.quick else None
            results = [run_case(layers, mode, workload, options, cache) for layers in workload["layers"] for mode in MODES]
        write_json(path, results)
    table, failures = report(results, workload, options)
    seconds = {f"{r['mode']} L{r['layers']}": r["seconds"] for r in results}
    conclude(options, HERE / "__main__.py", seconds, failures, table, workload=workload)


if __name__ == "__main__":
    main()
