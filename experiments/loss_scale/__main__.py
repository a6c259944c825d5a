"""Study 1: when does fp16 training need loss scaling, static or dynamic, and with which settings?

Same model, seed and data order for every run; only the precision flags differ. Each fp16/bf16
run records, at its first step and every ``log.grad_underflow_interval`` steps, the fraction of
gradient elements that are zero in the scaled low-precision gradients but not in fp32
(``lmfunc.train.grad_underflow``). ``python -m experiments.loss_scale [--quick]``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from experiments.harness import (
    Options, Run, conclude, last, load_results, markdown_table, parse_options, pyplot, run_colors, run_training,
    save_figure, series,
)
from lmfunc import model
from lmfunc.config.yaml_io import load_config
from lmfunc.data.corpus import embedded_documents
from lmfunc.data.tokenizer import load_tokenizer
from lmfunc.grad import value_and_grad
from lmfunc.loss import lm_loss_sum
from lmfunc.optim import global_norm

HERE = Path(__file__).resolve().parent
FP16 = ("--precision.compute-dtype", "fp16")
STATIC_EXPONENTS = (8, 12, 15, 20, 24)
RUNS = [
    Run("fp32"),
    Run("bf16", ("--precision.compute-dtype", "bf16")),
    Run("fp16_unscaled", FP16 + ("--precision.loss-scale", "1")),
    *[Run(f"fp16_static_2e{e}", FP16 + ("--precision.loss-scale", str(2.0**e))) for e in STATIC_EXPONENTS],
    # Megatron's defaults: initial 2^32, window 1000, hysteresis 2, min 1 (lmfunc's fp16 defaults).
    Run("fp16_dynamic_megatron", FP16),
    # torch.amp.GradScaler's defaults: initial 65536, growth every 2000 clean steps, x2, backoff
    # 0.5, no hysteresis (Megatron's hysteresis 1 backs off at the first overflow, as GradScaler).
    Run("fp16_dynamic_gradscaler", FP16 + ("--precision.initial-loss-scale", "65536",
                                           "--precision.loss-scale-window", "2000", "--precision.hysteresis", "1")),
]
QUICK_RUNS = ("fp32", "fp16_unscaled", "fp16_static_2e12", "fp16_dynamic_megatron")
# |final validation loss - fp32's| allowed for Megatron-default dynamic fp16. Its first ~16 steps are
# skipped while the scale falls from 2^32 (and the lr schedule waits for them): in the 40-step quick
# mode that is 40% of the run. In the 300-step full mode, runs that differ only in rounding (bf16,
# fp16 at different good scales) end up to 0.065 apart, so the margin is 0.1.
DYNAMIC_MARGIN = {"quick": 0.35, "full": 0.1}


def clip_order_example(config: Path, scale: float = 2.0**15) -> dict[str, float]:
    """The classic mistake, worked on real gradients: clipping the *scaled* gradients at
    ``optim.clip_grad`` and unscaling afterwards. The first batch of the embedded corpus, the
    config's model at initialisation, fp32."""
    cfg = load_config(str(config))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    seq, batch = cfg.data.seq_length, cfg.run.micro_batch_size
    ids = torch.tensor(tokenizer.encode("\n\n".join(embedded_documents()))[: batch * (seq + 1)]).view(batch, seq + 1)
    params = model.init(cfg.model, seed=cfg.run.seed)
    (loss_sum, count), grads = value_and_grad(lm_loss_sum, has_aux=True)(
        params, {"tokens": ids[:, :-1], "labels": ids[:, 1:]}, cfg.model)
    norm = float(global_norm(grads)) / float(count)  # the per-token mean's gradient norm
    threshold = cfg.optim.clip_grad
    right = min(norm, threshold)  # unscale, then clip: what lmfunc does
    wrong = min(scale * norm, threshold) / scale  # clip the scaled gradients, then unscale
    return {"grad_norm": norm, "clip_grad": threshold, "scale": scale, "scaled_norm": scale * norm,
            "clipped_norm_unscale_first": right, "clipped_norm_clip_first": wrong,
            "effective_threshold_clip_first": threshold / scale, "shrink_factor": right / wrong}


def summarise(results: dict[str, list[dict]], seconds: dict[str, float]) -> dict:
    """Per run: final validation loss and its difference from fp32, skipped steps, the scale's
    path, the underflow measurements; and the wall time of each run."""
    reference = last(results["fp32"], "valid", "loss")
    rows = {}
    for name, records in results.items():
        val = last(records, "valid", "loss")
        underflow = [r for r in records if r["kind"] == "underflow"]
        rows[name] = {
            "final_val_loss": val,
            "delta_vs_fp32": None if val is None or reference is None else val - reference,
            "skipped_steps": int(last(records, "train", "skipped_steps") or 0),
            "final_loss_scale": last(records, "train", "loss_scale"),
            "underflow": underflow,
            "max_underflow": max((r["all"] for r in underflow), default=None),
            "seconds": seconds.get(name),
        }
    return rows


def check(rows: dict, quick: bool) -> list[str]:
    """The study's invariants; the messages of those that fail."""
    failures = []
    margin = DYNAMIC_MARGIN["quick" if quick else "full"]
    delta = rows["fp16_dynamic_megatron"]["delta_vs_fp32"]
    if delta is None or abs(delta) > margin:
        failures.append(f"fp16 dynamic ends {delta} from fp32's validation loss (margin {margin})")
    if not rows["fp16_unscaled"]["max_underflow"]:
        failures.append("fp16 without loss scaling shows no gradient underflow")
    if rows["fp16_unscaled"]["max_underflow"] is not None and rows["fp16_static_2e12"]["max_underflow"] is not None:
        if rows["fp16_static_2e12"]["max_underflow"] >= rows["fp16_unscaled"]["max_underflow"]:
            failures.append("a static scale of 2^12 does not reduce the underflow of unscaled fp16")
    return failures


def report(results: dict[str, list[dict]], rows: dict, clip: dict, out: Path) -> str:
    """The plots (loss curves, loss-scale paths, underflow) and the Markdown tables."""
    plt = pyplot()
    colors = run_colors(list(results))
    fig, (ax_train, ax_delta) = plt.subplots(1, 2, figsize=(12, 4.5))
    ref_steps, ref_loss = series(results["fp32"], "train", "loss")
    for name, records in results.items():
        steps, loss = series(records, "train", "loss")
        style = {"color": colors[name], "linewidth": 2.5 if name == "fp32" else 1,
                 "linestyle": ":" if name == "fp16_static_2e24" else "-"}
        ax_train.plot(steps, loss, label=name, **style)
        common = {s: v for s, v in zip(ref_steps, ref_loss)}
        pairs = [(s, v - common[s]) for s, v in zip(steps, loss) if s in common and math.isfinite(v)]
        if name != "fp32" and pairs:
            ax_delta.plot(*zip(*pairs), label=name, linewidth=1, color=colors[name])
    ax_train.set(xlabel="step", ylabel="train loss (mean over 5 steps)", title="loss curves", ylim=(None, 6.5))
    ax_delta.set(xlabel="step", ylabel="train loss - fp32's", title="difference from fp32")
    ax_delta.axhline(0, color="black", linewidth=0.8)
    ax_train.legend(fontsize=7)
    save_figure(fig, out / "loss_curves.png")

    fig, (ax_scale, ax_under) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, records in results.items():
        steps, scale = series(records, "train", "loss_scale")
        if steps:
            ax_scale.plot(steps, [math.log2(s) for s in scale], label=name, marker=".", markersize=3, color=colors[name])
        under = rows[name]["underflow"]
        if under:
            ax_under.plot([r["step"] for r in under], [max(r["all"], 1e-7) for r in under], label=name, marker="o",
                          color=colors[name], linewidth=1)
    ax_scale.set(xlabel="step", ylabel="log2(loss scale)", title="loss scale")
    ax_under.set(xlabel="step", ylabel="fraction of gradient elements (log)", yscale="log",
                 title="gradient underflow, all parameters (1e-7 = none)")
    ax_scale.legend(fontsize=7)
    ax_under.legend(fontsize=7)
    save_figure(fig, out / "loss_scale_and_underflow.png")

    table = markdown_table(
        ["run", "final val loss", "Δ vs fp32", "skipped steps", "final scale", "max underflow (all params)"],
        [[name, r["final_val_loss"], r["delta_vs_fp32"], r["skipped_steps"],
          None if r["final_loss_scale"] is None else f"2^{math.log2(r['final_loss_scale']):.0f}",
          r["max_underflow"]] for name, r in rows.items()],
    )
    groups = ["embedding", "attention", "mlp", "norms", "all"]
    underflow_rows = []
    for name, r in rows.items():
        for u in r["underflow"]:
            underflow_rows.append([name, u["step"], f"2^{math.log2(u['loss_scale']):.0f}", *[u.get(g) for g in groups],
                                   u["overflow"]])
    underflow_table = markdown_table(["run", "step", "scale", *groups, "overflow (non-finite)"], underflow_rows)
    clip_table = markdown_table(["quantity", "value"], [[k, v] for k, v in clip.items()])
    text = (f"## Runs\n\n{table}\n## Gradient underflow per parameter group\n\n{underflow_table}\n"
            f"## Clipping before unscaling\n\n{clip_table}")
    (out / "results" / "tables.md").write_text(text)
    return text


def main(argv=None) -> None:
    options: Options = parse_options("loss_scale", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    runs = [run for run in RUNS if run.name in QUICK_RUNS] if options.quick else RUNS
    if options.report_only:
        summary_path = options.results / "summary.json"
        import json

        saved = json.loads(summary_path.read_text())
        seconds, clip = saved["seconds"], saved["clip_order_example"]
    else:
        seconds = {run.name: run_training(run, config, options)["seconds"] for run in runs}
        clip = clip_order_example(config)
    results = load_results(options, [run.name for run in runs])
    rows = summarise(results, seconds)
    failures = check(rows, options.quick)
    tables = report(results, rows, clip, options.out)
    conclude(options, config, seconds, failures, tables, clip_order_example=clip,
             runs={name: {k: v for k, v in r.items() if k != "underflow"} for name, r in rows.items()})


if __name__ == "__main__":
    main()
