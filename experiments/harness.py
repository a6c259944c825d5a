"""What every study shares: its command line, running ``python -m lmfunc.train`` (one process or
under torchrun), reading the runs' ``log.jsonl``, the machine description, Markdown tables and
matplotlib figures.

A study is a list of named runs (each a YAML config plus flags), run one after another in
subprocesses, so each run's peak memory is its own. ``--quick`` runs the study's quick config
into a scratch folder; the full mode writes the raw results into the study's ``results/`` folder
and its plots beside its README. ``--report-only`` redraws tables and plots from raw results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from lmfunc.train.log import read_log

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a study: its name (the folder and legend label), the flags added to the
    study's config, and the number of processes (torchrun when more than one)."""

    name: str
    flags: tuple[str, ...] = ()
    nproc: int = 1


@dataclasses.dataclass(frozen=True)
class Options:
    """A study's command line: quick or full, where results go, whether to only redraw."""

    quick: bool
    out: Path
    report_only: bool
    threads: int

    @property
    def results(self) -> Path:
        return self.out / "results"


def parse_options(study: str, description: str, argv: Optional[Sequence[str]] = None,
                  threads: Optional[int] = None) -> Options:
    """``--quick`` (the test's few-minute mode), ``--out DIR`` (default: the study's folder for the
    full mode, runs/experiments/STUDY-quick for the quick one), ``--report-only``, ``--threads``
    (default: ``threads`` for a study whose method fixes it, else $OMP_NUM_THREADS or 2)."""
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{study}", description=description)
    parser.add_argument("--quick", action="store_true", help="a few-minute version that checks the invariants")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of results/ and the plots (default: the study folder; quick: runs/experiments/STUDY-quick)")
    parser.add_argument("--report-only", action="store_true", help="redraw tables and plots from OUT/results")
    default_threads = threads if threads is not None else int(os.environ.get("OMP_NUM_THREADS", "2"))
    parser.add_argument("--threads", type=int, default=default_threads,
                        help=f"OMP_NUM_THREADS of each run (default: {default_threads})")
    args = parser.parse_args(argv)
    default = REPO / "runs" / "experiments" / f"{study}-quick" if args.quick else REPO / "experiments" / study
    return Options(quick=args.quick, out=(args.out or default).resolve(), report_only=args.report_only,
                   threads=args.threads)


def machine() -> dict[str, object]:
    """The CPU model, the ISA extensions that matter for low precision, cores, torch version."""
    model_name, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [name for name in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if name in flags]
    return {"cpu": model_name, "isa": isa, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}


HARNESS_MARK = ".experiments-harness-run"
"""The file that marks a run folder as written by ``run_training`` (the only folders it deletes)."""


def run_training(run: Run, config: Path, options: Options, timeout: float = 3600) -> dict:
    """Train ``run`` (``python -m lmfunc.train --config CONFIG FLAGS``) into OUT/runs/NAME, copy its
    ``log.jsonl`` to OUT/results/NAME.jsonl and return ``{"name", "seconds", "records"}``.

    A failed run raises ``RuntimeError`` with the end of its output (kept in OUT/runs/NAME.out). An
    earlier run of the same name is replaced only if the harness marked its folder as its own
    (``HARNESS_MARK`` inside, written before the run starts); any other folder or NAME.out there is
    refused, never deleted (``--out`` may point at a folder of the user's, even at lmfunc runs).
    """
    runs_dir = options.out / "runs"
    run_dir, output = runs_dir / run.name, runs_dir / f"{run.name}.out"
    if run_dir.exists() or output.exists():
        if not (run_dir / HARNESS_MARK).is_file():
            raise SystemExit(f"{run_dir} or {output.name} exists but was not written by this harness (no {HARNESS_MARK} "
                             "in the folder); move it away or choose another --out. Nothing was deleted.")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / HARNESS_MARK).write_text(json.dumps({"study_out": str(options.out), "run": run.name}) + "\n")
    options.results.mkdir(parents=True, exist_ok=True)
    args = ["--config", str(config), "--run.out-dir", str(runs_dir), "--run.name", run.name,
            "--data.cache-dir", str(options.out / "cache"), "--log.no-progress-bar", *run.flags]
    if run.nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(run.nproc), "-m", "lmfunc.train", *args]
    else:
        command = [sys.executable, "-m", "lmfunc.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "PYTHONPATH": str(REPO)}
    began = time.perf_counter()
    print(f"[{run.name}] {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - began
    (runs_dir / f"{run.name}.out").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise RuntimeError(f"run {run.name!r} failed (exit {done.returncode}):\n{tail}")
    shutil.copy(run_dir / "log.jsonl", options.results / f"{run.name}.jsonl")
    print(f"[{run.name}] done in {seconds:.0f} s", flush=True)
    return {"name": run.name, "seconds": seconds, "records": read_log(str(run_dir / "log.jsonl"))}


def load_results(options: Options, names: Iterable[str]) -> dict[str, list[dict]]:
    """The saved ``log.jsonl`` records of each named run (OUT/results/NAME.jsonl)."""
    missing = [name for name in names if not (options.results / f"{name}.jsonl").exists()]
    if missing:
        raise SystemExit(f"no raw results for {missing} in {options.results}; run the study without --report-only first")
    return {name: read_log(str(options.results / f"{name}.jsonl")) for name in names}


def series(records: list[dict], kind: str, field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``field`` over the records of ``kind`` that have it."""
    picked = [r for r in records if r["kind"] == kind and r.get(field) is not None]
    return [r["step"] for r in picked], [float(r[field]) for r in picked]


def last(records: list[dict], kind: str, field: str) -> Optional[float]:
    """The last value of ``field`` among the records of ``kind``; None when there is none."""
    values = series(records, kind, field)[1]
    return values[-1] if values else None


def write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1) + "\n")


def conclude(options: Options, config: Path, seconds: dict[str, float], failures: list[str], tables: str,
             **fields: object) -> None:
    """The end of every study: write OUT/results/summary.json (machine, config, each run's seconds,
    ``fields``, the failed invariants), print the tables, and exit non-zero naming the invariants
    that failed (else print "invariants hold")."""
    write_json(options.results / "summary.json", {"machine": machine(), "config": config.name, "seconds": seconds,
                                                  **fields, "invariants_failed": failures})
    print(tables)
    if failures:
        raise SystemExit("invariants failed:\n- " + "\n- ".join(failures))
    print("invariants hold")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table; floats with 4 significant digits."""
    def cell(value: object) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or a clear error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('the plots need matplotlib: pip install -e ".[experiments]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_colors(names: Sequence[str]) -> dict[str, object]:
    """One fixed colour per run across a study's figures: black for the first (the reference), then
    matplotlib's tab10 and tab20 palettes."""
    plt = pyplot()
    palette = list(plt.get_cmap("tab10").colors) + list(plt.get_cmap("tab20").colors[1::2])
    return {name: "black" if i == 0 else palette[(i - 1) % len(palette)] for i, name in enumerate(names)}


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
