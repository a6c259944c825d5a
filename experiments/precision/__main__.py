"""Study 3: fp32, bf16 and fp16 (dynamic loss scaling): loss, speed and memory on this machine.

Two parts. Quality: the loss-scale study's model, 300 steps per dtype (curves, final validation
loss, tokens/s, peak RSS). Speed: the default model (``python -m lmfunc.train``'s), 12 compiled
steps per dtype, and the matmul that dominates it, timed alone. bf16/fp16 speed on a CPU depends
on its ISA (AVX-512 BF16/FP16, AMX), so the machine is recorded.
``python -m experiments.precision [--quick]`` (the quick mode skips the speed part).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from experiments.harness import (
    Options, Run, conclude, last, load_results, markdown_table, parse_options, pyplot, run_colors,
    run_training, save_figure,
    series,
)

HERE = Path(__file__).resolve().parent
DTYPES = ("fp32", "bf16", "fp16")
# fp16 with dynamic scaling from 2^16, the loss-scale study's recommendation (Megatron's 2^32 start
# only adds ~16 skipped steps); Megatron's window 1000 and hysteresis 2.
FLAGS = {"fp32": (), "bf16": (), "fp16": ("--precision.initial-loss-scale", "65536")}
RUNS = [Run(dtype, ("--precision.compute-dtype", dtype, *FLAGS[dtype])) for dtype in DTYPES]
SPEED_RUNS = [Run(f"speed_{dtype}", ("--precision.compute-dtype", dtype, *FLAGS[dtype])) for dtype in DTYPES]
# |final validation loss - fp32's| allowed. Runs that differ only in rounding end up to ~0.065 apart
# after 300 steps (the loss-scale study).
MARGIN = {"quick": {"bf16": 0.1, "fp16": 0.1}, "full": {"bf16": 0.1, "fp16": 0.1}}


def matmul_speed(m: int = 2048, k: int = 256, n: int = 768, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Milliseconds and GFLOP/s of one ``[m, k] @ [k, n]`` matmul per dtype: the default model's
    MLP projection on one step's 2048 tokens."""
    speed = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        began = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = (time.perf_counter() - began) / repeats
        speed[name] = {"ms": 1e3 * seconds, "gflop_s": 2 * m * k * n / seconds / 1e9}
    return speed


def summarise(results: dict[str, list[dict]], reference_run: str) -> dict[str, dict]:
    """Per run: final validation loss (and its difference from ``reference_run``'s), the median
    tokens/s over the log intervals, peak RSS, skipped steps."""
    reference = last(results[reference_run], "valid", "loss")
    rows = {}
    for name, records in results.items():
        val = last(records, "valid", "loss")
        train = [r for r in records if r["kind"] == "train" and r.get("tokens_per_s")]
        rates = sorted(r["tokens_per_s"] for r in train)
        rows[name] = {
            "final_val_loss": val,
            "delta_vs_fp32": None if val is None or reference is None else val - reference,
            "tokens_per_s": rates[len(rates) // 2] if rates else None,  # the median log interval
            "peak_rss_mib": max((r.get("mem_peak_rss_mib", 0.0) for r in records if r["kind"] == "train"), default=None),
            "skipped_steps": int(last(records, "train", "skipped_steps") or 0),
        }
    return rows


def check(rows: dict, quick: bool) -> list[str]:
    failures = []
    for dtype, margin in MARGIN["quick" if quick else "full"].items():
        delta = rows[dtype]["delta_vs_fp32"]
        if delta is None or abs(delta) > margin:
            failures.append(f"{dtype} ends {delta} from fp32's validation loss (margin {margin})")
    failures += [f"{name}: no tokens/s or peak memory logged" for name, r in rows.items()
                 if not r["tokens_per_s"] or not r["peak_rss_mib"]]
    return failures


def report(results: dict[str, list[dict]], rows: dict, speed_rows: dict, matmul: dict, out: Path) -> str:
    plt = pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = run_colors(list(DTYPES))
    for name in DTYPES:
        style = {"color": colors[name], "linewidth": 3 if name == "fp32" else 1.2}
        ax_train.plot(*series(results[name], "train", "loss"), label=name, **style)
        ax_val.plot(*series(results[name], "valid", "loss"), label=name, marker="o", markersize=3, **style)
    ax_train.set(xlabel="step", ylabel="train loss", title="train loss", ylim=(None, 6.5))
    ax_val.set(xlabel="step", ylabel="validation loss", title="validation loss")
    ax_train.legend()
    save_figure(fig, out / "precision_curves.png")
    quality = markdown_table(
        ["dtype", "final val loss", "Δ vs fp32", "skipped steps", "tokens/s", "peak RSS MiB"],
        [[n, r["final_val_loss"], r["delta_vs_fp32"], r["skipped_steps"], r["tokens_per_s"], r["peak_rss_mib"]]
         for n, r in rows.items()],
    )
    steps = max(r["step"] for r in results["fp32"])
    text = f"## Quality (the loss-scale study's model, {steps} steps)\n\n{quality}"
    if speed_rows:
        speed = markdown_table(
            ["dtype", "default model tokens/s", "vs fp32", "peak RSS MiB", "matmul 2048x256x768 ms", "matmul GFLOP/s"],
            [[d, speed_rows[f"speed_{d}"]["tokens_per_s"],
              speed_rows[f"speed_{d}"]["tokens_per_s"] / speed_rows["speed_fp32"]["tokens_per_s"],
              speed_rows[f"speed_{d}"]["peak_rss_mib"], matmul[d]["ms"], matmul[d]["gflop_s"]] for d in DTYPES],
        )
        text += f"\n## Speed (default model, compiled)\n\n{speed}"
    (out / "results" / "tables.md").write_text(text)
    return text


def main(argv=None) -> None:
    options: Options = parse_options("precision", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    speed_runs = [] if options.quick else SPEED_RUNS
    if options.report_only:
        saved = json.loads((options.results / "summary.json").read_text())
        seconds, matmul = saved["seconds"], saved["matmul"]
    else:
        matmul = matmul_speed()
        seconds = {run.name: run_training(run, config, options)["seconds"] for run in RUNS}
        seconds |= {run.name: run_training(run, HERE / "speed.yaml", options)["seconds"] for run in speed_runs}
    results = load_results(options, [run.name for run in RUNS])
    rows = summarise(results, "fp32")
    speed_rows = summarise(load_results(options, [run.name for run in speed_runs]), "speed_fp32") if speed_runs else {}
    failures = check(rows, options.quick)
    tables = report(results, rows, speed_rows, matmul, options.out)
    conclude(options, config, seconds, failures, tables, matmul=matmul, quality=rows, speed=speed_rows)


if __name__ == "__main__":
    main()
