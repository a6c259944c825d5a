"""A dry run's report for one rank role: memory, collectives, FLOPs, and a projected step time and
MFU on the target hardware, beside ``lmfunc.plan``'s numbers.

The projection (an upper bound on MFU: compute runs at the datasheet peak):
- compute: the graph's FLOPs at the peak FLOP/s of the compute dtype;
- each collective: its bytes on the wire of a ring algorithm over its group (an all-gather moves
  ``(n - 1) x`` its input, a reduce-scatter and an all-to-all ``(n - 1) / n`` of it, an all-reduce
  ``2 (n - 1) / n``), at NVLink bandwidth when every rank of its group is on one node, else at the
  network's (per GPU);
- pipeline bubble: with pipeline parallelism, Megatron's bubble fraction ``(pp - 1) / (v m)`` of the
  compute (``v`` stages per rank: the virtual stages, 2 for the V schedules; ``m`` microbatches) is added (idle time; the zero-bubble schedules
  idle less); a stage's sends are on the critical path (a receive is its sender's send);
- overlap: the data-parallel collectives (parameter gathers, gradient reductions: groups over
  ``dp_replicate``/``dp_shard`` only), which lmfunc buckets and issues ahead of the compute that
  needs them, hide behind the step's compute; every other one (tensor, sequence, context and
  expert parallelism's, the step's scalars) waits on the critical path. Exposed communication is
  ``max(0, data-parallel time - compute time)`` plus all the others.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from lmfunc.config.model import ConfigError
from lmfunc.dryrun.graph_report import CollectiveUse, MemoryReport, StepFacts
from lmfunc.metrics import table_peak_flops
from lmfunc.plan.memory import (GRADIENTS_TERM, KEPT_TERM, RECEIVE_TERM, STATE_TERM, WORKING_TERM,
                                 MemoryPlan)

GiB = 2**30
DATA_PARALLEL = {"dp_replicate", "dp_shard", "dp_replicate+dp_shard"}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The target: one GPU's peak FLOP/s (the compute dtype's), memory, and the bandwidth of one
    direction of its links (NVLink within a node, the network between nodes)."""

    name: str
    peak_flops: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    gpus_per_node: int = 8


GPU_MEMORY = {"h100": 80 * 10**9, "h200": 141 * 10**9}
"""Datasheet memory (80 GB HBM3, 141 GB HBM3e)."""
NVLINK = 450e9
"""NVLink 4 (H100/H200 SXM): 900 GB/s per GPU, both directions together."""
NETWORK = 50e9
"""One 400 Gb/s InfiniBand NDR (or RoCE) NIC per GPU."""


def hardware(gpu: str, compute_dtype: str, tf32: bool, gpus_per_node: int = 8, peak_flops: Optional[float] = None,
             memory_bytes: Optional[float] = None, nvlink: Optional[float] = None,
             network: Optional[float] = None) -> Hardware:
    """The target ``gpu`` (``h100`` or ``h200``, SXM) with any value overridden."""
    if gpu not in GPU_MEMORY:
        raise ConfigError(f"--gpu must be one of {sorted(GPU_MEMORY)}, got {gpu!r}; give other hardware with "
                          "--peak-tflops, --gpu-memory-gib, --nvlink-gbps and --network-gbps")
    peak = peak_flops if peak_flops is not None else table_peak_flops(gpu.upper(), compute_dtype, tf32)[0]
    return Hardware(f"{gpu.upper()} SXM", peak, memory_bytes or GPU_MEMORY[gpu], nvlink or NVLINK, network or NETWORK,
                    gpus_per_node)


def _wire_factor(kind: str, n: int) -> float:
    if kind == "all_gather_into_tensor":
        return n - 1
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("broadcast", "send"):
        return 1.0
    if kind == "recv":
        return 0.0  # the sender's time
    return (n - 1) / n  # reduce-scatter, all-to-all


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    use: CollectiveUse
    group_size: int
    link: str
    seconds: Optional[float]
    overlapped: bool


@dataclasses.dataclass(frozen=True)
class RoleReport:
    """What one rank role's step holds, sends and computes."""

    role: str
    rank: int
    trace_seconds: float
    traced: str
    memory: MemoryReport
    collectives: list[CollectiveTime]
    flops: int
    flops_estimated_ops: int
    compute_seconds: float
    exposed_seconds: float
    plan_peak: Optional[int]
    plan_flops: float
    """Megatron's count for an even share of the step (``lmfunc.plan``: no recompute): the MFU numerator."""
    bubble_seconds: float = 0.0
    plan_terms: tuple[tuple[str, int], ...] = ()
    """``lmfunc.plan``'s peak split as the dry run's (``MemoryPlan.terms``); empty without a plan."""

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.bubble_seconds + self.exposed_seconds

    def mfu(self, hw: Hardware) -> float:
        return self.plan_flops / (self.step_seconds * hw.peak_flops)


def role_report(role: str, facts: StepFacts, hw: Hardware, plan: Optional[MemoryPlan], plan_flops: float,
                bubble_fraction: float = 0.0) -> RoleReport:
    """The report of one role's step ``facts`` on ``hw`` (module docstring) beside ``lmfunc.plan``'s
    memory ``plan`` for it (None where the plan does not predict the layout); ``bubble_fraction``:
    the pipeline's idle time, a fraction of the compute."""
    compute = facts.flops / hw.peak_flops
    times, data_parallel, exposed = [], 0.0, 0.0
    for use in facts.collectives:
        ranks = facts.dims_ranks.get(use.dims, [])
        nodes = {rank // hw.gpus_per_node for rank in ranks}
        link = "nvlink" if len(nodes) <= 1 else "network"
        bandwidth = hw.nvlink_bytes_per_s if link == "nvlink" else hw.network_bytes_per_s
        n = max(len(ranks), 1)
        seconds = None if use.bytes is None else use.bytes * _wire_factor(use.kind, n) / bandwidth
        overlapped = use.dims in DATA_PARALLEL
        times.append(CollectiveTime(use, n, link, seconds, overlapped))
        if overlapped:
            data_parallel += seconds or 0.0
        else:
            exposed += seconds or 0.0
    exposed += max(0.0, data_parallel - compute)
    return RoleReport(role, facts.rank, facts.trace_seconds, facts.traced, facts.memory, times, facts.flops,
                      facts.flops_estimated_ops, compute, exposed, plan.peak if plan else None, plan_flops,
                      compute * bubble_fraction, plan.terms() if plan else ())


TERM_MEANINGS = {
    STATE_TERM: "the parameters, optimizer state and batch (the step's inputs)",
    GRADIENTS_TERM: "the gradients (in buckets, summed over microbatches)",
    KEPT_TERM: "the activations kept for the backward",
    RECEIVE_TERM: "the pipeline stages' receive buffers",
    WORKING_TERM: "the working set (activation gradients, gathered and cast parameters, logits, temporaries)",
}
"""What each term of a peak (``MemoryReport.terms``) holds, as an out-of-memory refusal names it."""


def check_fits(report: RoleReport, hw: Hardware) -> None:
    """A ``ConfigError`` when the role's peak exceeds the GPU's memory, naming the role and its
    largest term, and the largest buffer live at the peak where it can be part of that term (a
    pipeline role's largest entry is the whole of what its graphs keep between them: not named)."""
    mem = report.memory
    if mem.peak <= hw.memory_bytes:
        return
    name, size = max(mem.terms, key=lambda t: t[1])
    largest = TERM_MEANINGS.get(name, name)
    if name != STATE_TERM and mem.largest and mem.largest[0][1] <= size:
        largest += f"; the largest of what is live there: {mem.largest[0][0]} of {mem.largest[0][1] / GiB:.1f} GiB"
    raise ConfigError(
        f"out of memory on rank role '{report.role}' (rank {report.rank}): the step's peak is {mem.peak / GiB:.1f} GiB, "
        f"the {hw.name} has {hw.memory_bytes / GiB:.1f} GiB; the largest term is {size / GiB:.1f} GiB: {largest}. "
        "Shard more (parallel.dp_shard, tp, pp, ep), recompute (model.recompute_granularity) or use a smaller "
        "micro batch")


def _percent(got: float, want: Optional[float]) -> str:
    return "-" if not want else f"{100 * (got - want) / want:+.1f}%"


def format_report(report: RoleReport, hw: Hardware) -> str:
    """The role's report as text, with ``lmfunc.plan``'s numbers beside the dry run's."""
    mem = report.memory
    lines = [f"rank role '{report.role}' (rank {report.rank}; {report.traced}, in {report.trace_seconds:.1f} s)",
             f"  memory: peak {_gib(mem.peak)} (plan {_gib(report.plan_peak)}, "
             f"{_percent(mem.peak, report.plan_peak)}); the step's inputs (params, optimizer state, batch) "
             f"{_gib(mem.inputs)}; at node {mem.at_node}"]
    if mem.terms:
        planned = dict(report.plan_terms)
        lines.append("    split like the plan: " + "; ".join(
            f"{name} {_gib(size)} (plan {_gib(planned.get(name))}, {_percent(size, planned.get(name))})"
            for name, size in mem.terms))
    lines += [f"    live there: {name} {_gib(size)}" for name, size in mem.largest]
    lines.append(f"  FLOPs: {report.flops:.4g} on the graph (recomputation included); Megatron's count for an even share "
                 f"{report.plan_flops:.4g} ({_percent(report.flops, report.plan_flops)})"
                 + (f"; {report.flops_estimated_ops} ops of sizes known only at run time counted at an even share of "
                    "the experts' tokens" if report.flops_estimated_ops else ""))
    lines.append("  collectives of one step (group size, link, time at the link's bandwidth):")
    for t in report.collectives:
        use = t.use
        amount = "unknown bytes (sizes known at run time)" if use.bytes is None else _gib(use.bytes)
        time = "-" if t.seconds is None else f"{1e3 * t.seconds:.3f} ms"
        lines.append(f"    {use.kind:<24s} over {use.dims:<22s} x{use.count:<5d} {amount:>14s}  n={t.group_size} "
                     f"{t.link} {time}{' (overlapped)' if t.overlapped else ''}")
    lines.append(f"  projected on {hw.name} ({hw.peak_flops / 1e12:.0f} TFLOP/s, NVLink {hw.nvlink_bytes_per_s / 1e9:.0f}"
                 f" GB/s, network {hw.network_bytes_per_s / 1e9:.0f} GB/s per GPU): compute {1e3 * report.compute_seconds:.2f}"
                 f" ms + pipeline bubble {1e3 * report.bubble_seconds:.2f} ms + exposed communication {1e3 * report.exposed_seconds:.2f} ms = step {1e3 * report.step_seconds:.2f}"
                 f" ms; MFU at most {100 * report.mfu(hw):.1f}% (compute at peak; data-parallel collectives overlapped)")
    return "\n".join(lines)


def _gib(value: Optional[float]) -> str:
    """Bytes in GiB, or in MiB below one GiB."""
    if value is None:
        return "-"
    return f"{value / GiB:.2f} GiB" if value >= GiB else f"{value / 2**20:.2f} MiB"


def report_json(report: RoleReport, hw: Hardware) -> dict:
    """The role's report as plain JSON values."""
    mem = report.memory
    return {
        "role": report.role, "rank": report.rank, "trace_seconds": report.trace_seconds, "traced": report.traced,
        "memory": {"peak_bytes": mem.peak, "input_bytes": mem.inputs, "at_node": mem.at_node,
                   "largest": [{"buffer": n, "bytes": b} for n, b in mem.largest],
                   "terms": [{"term": n, "bytes": b, "plan_bytes": dict(report.plan_terms).get(n)} for n, b in mem.terms],
                   "plan_peak_bytes": report.plan_peak},
        "flops": report.flops, "flops_estimated_ops": report.flops_estimated_ops, "plan_flops": report.plan_flops,
        "collectives": [{"kind": t.use.kind, "dims": t.use.dims, "count": t.use.count, "elements": t.use.elements,
                         "bytes": t.use.bytes, "group_size": t.group_size, "link": t.link, "seconds": t.seconds,
                         "overlapped": t.overlapped} for t in report.collectives],
        "projection": {"compute_seconds": report.compute_seconds, "bubble_seconds": report.bubble_seconds,
                       "exposed_seconds": report.exposed_seconds,
                       "step_seconds": report.step_seconds, "mfu": report.mfu(hw), "hardware": dataclasses.asdict(hw)},
    }
