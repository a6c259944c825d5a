"""Where a cold compile's time goes: torch's compile timers grouped into phases, per variant.

``python -m experiments.bench --variants func-compiled module-compiled --phases`` prints, after the
usual table, each variant's first-step compile split into the phases below (seconds, median over
the repeats). The timers are torch's own (``torch._dynamo.utils.compile_times``, summed over every
graph a variant compiles: lmfunc's one step graph; the module's forward, backward and optimizer
graphs). Timers nest (Inductor's lowering runs inside AOTAutograd), so each phase here is one that
no other phase contains, and "other" is the compile time none of them covers. "C++ libraries" counts
the distinct kernel libraries GCC built (files in the worker's fresh Inductor cache).
"""

from __future__ import annotations

import statistics
from pathlib import Path

PHASES: dict[str, tuple[str, ...]] = {
    "Dynamo: bytecode tracing": ("bytecode_tracing",),
    "Dynamo: guards": ("build_guards",),
    "AOTAutograd: metadata (functional retrace)": ("aot_collect_metadata",),
    "AOTAutograd: joint forward-backward trace": ("aot_trace_joint_graph",),
    "AOTAutograd: joint-graph passes": ("_recursive_joint_graph_passes",),
    "AOTAutograd: partition (min-cut)": ("min_cut_rematerialization_partition",),
    "Inductor: post-grad passes (lmfunc's included)": ("_recursive_post_grad_passes",),
    "  of which lmfunc's (recompute, slice copies, scans, buckets)": (
        "pass.post_grad_passes.post_grad_custom_pre_pass", "pass.post_grad_passes.post_grad_custom_post_pass"),
    "Inductor: lowering to IR": ("GraphLowering.run",),
    "Inductor: scheduling and fusion": ("Scheduler.__init__",),
    "Inductor: kernel code generation (Python)": ("Scheduler.codegen",),
    "Inductor: waiting for the C++ builds": ("async_compile.wait",),
    "lmfunc: the C++ kernels' batched builds": ("lmfunc.kernel_batches.build",),
}
"""Phase name -> the torch compile timers it sums. The indented phase is part of the one above it
and is left out of the sum that gives "other"."""


def compile_timer_seconds() -> dict[str, float]:
    """This process's torch compile timers so far: timer name -> seconds, summed over graphs."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: float(value) for name, value in zip(names, values)}


def kernel_libraries(cache_dir: str) -> int:
    """How many C++ kernel libraries Inductor wrote the sources of into ``cache_dir`` (each one GCC
    build: one kernel, or with lmfunc a batch of them, ``lmfunc.compiler.kernel_batches``)."""
    return sum(1 for _ in Path(cache_dir).glob("*/*.main.cpp"))


def phase_seconds(timers: dict[str, float], compile_s: float) -> dict[str, float]:
    """``PHASES`` summed from ``timers``, plus "other": ``compile_s`` less the top-level phases."""
    phases = {name: sum(timers.get(key, 0.0) for key in keys) for name, keys in PHASES.items()}
    top_level = sum(seconds for name, seconds in phases.items() if not name.startswith(" "))
    return {**phases, "other (Python between the phases, imports, first run)": compile_s - top_level}


def phase_table(runs: dict[str, list[dict]]) -> str:
    """A markdown table: one row per phase, one column per variant (median seconds over its runs),
    then the compile time and the number of C++ libraries GCC built."""
    variants = [v for v, results in runs.items() if results and "timers" in results[0]]
    if not variants:
        return "no compiled variant: no compile phases to show"
    medians = {}
    for variant in variants:
        per_run = [phase_seconds(r["timers"], r["compile_s"]) for r in runs[variant]]
        medians[variant] = {name: statistics.median(p[name] for p in per_run) for name in per_run[0]}
    lines = ["| phase | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for name in medians[variants[0]]:
        lines.append(f"| {name} | " + " | ".join(f"{medians[v][name]:.1f}" for v in variants) + " |")
    lines.append("| **compile (first step - steady step)** | " + " | ".join(
        f"**{statistics.median(r['compile_s'] for r in runs[v]):.1f}**" for v in variants) + " |")
    lines.append("| C++ libraries built (GCC runs) | " + " | ".join(
        f"{statistics.median(r['kernels'] for r in runs[v]):.0f}" for v in variants) + " |")
    return "\n".join(lines)
