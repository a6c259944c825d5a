"""``python -m tests.compat_losses RUN_DIR...``: the first train losses of the default job's runs
on different torches agree to a relative tolerance (``.ci/run``'s compat tiers: 2.11, 2.13 and 2.15).

Each RUN_DIR is a ``--run.out-dir`` of ``python -m lmfunc.train``; its ``*/log.jsonl`` holds one
``{"kind": "train", "step": N, "loss": X}`` record per logged step. Exits 1 naming the first step
and runs that differ, or a run with too few steps; prints the largest relative difference."""

from __future__ import annotations

import argparse
import glob
import json
import sys


def train_losses(run_dir: str) -> dict[int, float]:
    """Step -> loss of the one run under ``run_dir``."""
    logs = glob.glob(f"{run_dir}/*/log.jsonl")
    if len(logs) != 1:
        raise SystemExit(f"compat_losses: expected one */log.jsonl under {run_dir}, found {len(logs)}")
    with open(logs[0]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def compare(runs: dict[str, dict[int, float]], steps: int, rtol: float) -> tuple[float, list[str]]:
    """The largest relative difference from the first run over steps 1..``steps``, and a line for
    each step where a run differs by more than ``rtol`` or lacks the step."""
    names = list(runs)
    reference = runs[names[0]]
    worst, problems = 0.0, []
    for step in range(1, steps + 1):
        for name in names:
            if step not in runs[name]:
                problems.append(f"{name} has no loss at step {step}")
                continue
            difference = abs(runs[name][step] - reference[step]) / abs(reference[step])
            worst = max(worst, difference)
            if difference > rtol:
                problems.append(f"step {step}: {name} {runs[name][step]!r} against {names[0]} {reference[step]!r} "
                                f"(relative {difference:.2e} > {rtol:g})")
    return worst, problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    worst, problems = compare({d: train_losses(d) for d in args.run_dirs}, args.steps, args.rtol)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        raise SystemExit(1)
    print(f"compat_losses: the first {args.steps} losses of {len(args.run_dirs)} runs agree "
          f"(largest relative difference {worst:.2e}, tolerance {args.rtol:g})")


if __name__ == "__main__":
    main()
