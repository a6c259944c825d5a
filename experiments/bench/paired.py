"""Paired step timing: several training steps built in one process and run in turn, round after round.

On a shared machine the speed of a whole process drifts (other jobs take turns on the cores), so
two variants timed in separate processes can differ by a few percent that neither causes. Timed in
turn inside one process, the two steps of a round see the same conditions, and the per-round ratio
of their times cancels the drift. ``python -m experiments.bench --paired`` uses this for speed; peak
memory still needs a process per variant (the default mode).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

from experiments.bench.config import BenchConfig
from experiments.bench.workload import make_step


def round_orders(names: Sequence[str], rounds: int) -> list[tuple[str, ...]]:
    """The order of the variants in each round: round r takes the r-th of their n! orders
    (``itertools.permutations``, cycling), so over n! rounds each variant runs in each position,
    and directly after each of the others, equally often."""
    orders = list(itertools.permutations(names))
    return [orders[r % len(orders)] for r in range(rounds)]


def time_in_turn(
    steps: Mapping[str, Callable[[], Any]], rounds: int, wait: Callable[[Any], Any] = float,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Run every step once per round (orders from ``round_orders``) and return each step's
    seconds per round. ``wait(result)`` blocks until the step's work is done (``float`` of a loss
    tensor: on CUDA this synchronises) and is inside the timed interval."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for order in round_orders(list(steps), rounds):
        for name in order:
            start = clock()
            wait(steps[name]())
            times[name].append(clock() - start)
    return times


def paired_summary(times: Mapping[str, Sequence[float]], reference: str) -> dict[str, dict[str, float]]:
    """Per variant: ``median_s`` (its median seconds per step) and its per-round time ratio to
    ``reference`` (``ratio_median``, ``ratio_q25``, ``ratio_q75``: below 1 is faster) with
    ``faster_rounds`` (rounds in which it was faster) out of ``rounds``. Every variant must have
    one time per round."""
    if reference not in times:
        raise ValueError(f"paired_summary: reference variant {reference!r} is not among {sorted(times)}")
    rounds = len(times[reference])
    uneven = {name: len(t) for name, t in times.items() if len(t) != rounds}
    if uneven or rounds == 0:
        raise ValueError(f"paired_summary: every variant needs the same number (> 0) of rounds; "
                         f"{reference!r} has {rounds}, others {uneven}")
    summary = {}
    for name, own in times.items():
        ratios = [a / b for a, b in zip(own, times[reference])]
        q25, _, q75 = statistics.quantiles(ratios, n=4, method="inclusive") if rounds > 1 else (ratios[0],) * 3
        summary[name] = {
            "median_s": statistics.median(own), "ratio_median": statistics.median(ratios),
            "ratio_q25": q25, "ratio_q75": q75,
            "faster_rounds": sum(a < b for a, b in zip(own, times[reference])), "rounds": rounds,
        }
    return summary


def run_paired_worker(bc: BenchConfig) -> dict:
    """``--paired`` worker: build every variant here, compile and warm each up, then time them in
    turn for ``bc.steps`` rounds; returns ``{"first_loss": {...}, "times": {variant: [s, ...]}}``."""
    import torch


    torch.set_num_threads(bc.threads)
    steps = {variant: make_step(bc, variant) for variant in bc.variants}
    first_loss = {variant: float(step()) for variant, step in steps.items()}
    for step in steps.values():
        for _ in range(bc.warmup):
            float(step())
    return {"first_loss": first_loss, "times": time_in_turn(steps, bc.steps)}


def report(bc: BenchConfig, results: list[dict], tokens: int, mfu_per_token_s: float) -> None:
    """Print the pooled rounds of the ``--paired`` workers, each variant against the last one, then
    each process's own medians: another job busy during all of a process's rounds can slow one
    variant more than the other, which pairing within the process does not cancel, so compare
    several processes."""
    reference = bc.variants[-1]
    times = {v: [t for result in results for t in result["times"][v]] for v in bc.variants}
    summary = paired_summary(times, reference)
    rounds = summary[reference]["rounds"]
    print(f"paired: {len(results)} process(es) x {bc.steps} rounds (one step of each variant per round, the order changing); "
          f"ratio = a variant's time / {reference}'s time in the same round (below 1: faster)")
    print(f"{'variant':16s} {'tokens/s':>9s} {'ms/step':>9s} {'MFU':>6s} {'ratio':>7s} {'[q25, q75]':>16s} "
          f"{'faster in':>10s} {'loss0':>8s}")
    for variant, row in summary.items():
        step_s = row["median_s"]
        print(f"{variant:16s} {tokens / step_s:9.0f} {step_s * 1e3:9.1f} {tokens / step_s * mfu_per_token_s:6.1%} "
              f"{row['ratio_median']:7.4f} [{row['ratio_q25']:.4f}, {row['ratio_q75']:.4f}] "
              f"{row['faster_rounds']:4d}/{rounds:<5d} {results[0]['first_loss'][variant]:8.4f}")
    per_process = [paired_summary(result["times"], reference) for result in results]
    for variant in bc.variants[:-1]:
        rows = [summary_of_process[variant] for summary_of_process in per_process]
        print(f"  {variant} per process: ms/step " + ", ".join(f"{row['median_s'] * 1e3:.1f}" for row in rows)
              + "; ratio " + ", ".join(f"{row['ratio_median']:.4f}" for row in rows))
    if bc.json_out:
        with open(bc.json_out, "w") as f:
            json.dump({"config": dataclasses.asdict(bc), "paired": summary, "times": times}, f, indent=2)
