"""A deep model's long step, dry-run from small copies of it.

A step of ``L`` identical layers and ``M`` microbatches unrolls ``L x M`` layer graphs; tracing it
whole for a real model (80 layers, 64 microbatches) would take hours. Every number the dry run
reports is a sum over that structure: per step, per microbatch, per layer, and per layer and
microbatch. So each is ``a + b L + c M + d L M``, as long as every layer's graph is the same one
(the same code on the same config, only its parameters differ) and every microbatch's too. The
four coefficients come from traces at ``(L, M)`` = (1, 1), (2, 1), (1, 2), (2, 2); a fifth trace at
(3, 3) is the proof: its collectives (counts, elements, bytes), FLOPs and input bytes must equal
the formula's exactly, else the run is refused with the first number that differs. Peak memory is
no such sum (the microbatches run one after another): it is fitted in the depth at 3
microbatches, at 2 and 4 layers (``_peak``), where Inductor's scheduler may place a buffer a little
differently in a deeper graph, so it is held to the 3-layer trace within ``MEMORY_TOLERANCE``.
Only models whose layers are all alike extrapolate (all dense, or all MoE); a model that mixes
them is traced whole.
"""

from __future__ import annotations

import dataclasses
import time

from lmfunc.config.model import ConfigError
from lmfunc.config.train import TrainConfig
from lmfunc.dryrun.capture import batch_plan, trace_rank
from lmfunc.train.run_step import even_expert_share
from lmfunc.dryrun.graph_report import CollectiveUse, MemoryReport, StepFacts, one_graph_terms, step_facts
from lmfunc.parallel.mesh import Layout

FIT_POINTS = ((1, 1), (2, 1), (1, 2), (2, 2))
CHECK_POINT = (3, 3)
MEMORY_TOLERANCE = 0.02
"""How far the ``PEAK_CHECK_DEPTH``-layer trace's peak may be from the fit's, relative."""
PEAK_FIT_DEPTHS = (2, 4)
"""The depths the peak memory is fitted at. Not 1: with FSDP the backward gathers the next layer's
parameters while a layer computes (``lmfunc.compiler.collective_buckets``), so from 2 layers on the
peak holds two layers' gathered parameters, and a 1-layer step only one. Two layers apart: the
peak of a deep FSDP step grows by alternating steps from one layer to the next (Llama-3-8B on
dp_shard 8: 1.02 and 1.39 GiB), as Inductor pairs the layers' buffers."""
PEAK_CHECK_DEPTH = 3
"""The depth between the fit's whose trace the fit is held to."""
WHOLE_STEP_LIMIT = 12
"""Steps of at most this many layer-microbatches (L x M) are traced whole."""


def shrunk(cfg: TrainConfig, world_size: int, layers: int, microbatches: int) -> TrainConfig:
    """``cfg`` with ``layers`` layers and a global batch of ``microbatches`` microbatches per
    data-parallel rank (validated for ``world_size``)."""
    dp = Layout(cfg.parallel.sizes(world_size), None).data_parallel_size
    model = dataclasses.replace(cfg.model, num_layers=layers)
    run = dataclasses.replace(cfg.run, global_batch_size=microbatches * cfg.run.micro_batch_size * dp,
                              rampup_batch_size=None)
    return cfg.replace(model=model, run=run).validate(world_size)


def _bilinear(values: dict[tuple[int, int], float], layers: int, microbatches: int) -> float:
    f11, f21, f12, f22 = (values[p] for p in FIT_POINTS)
    d = f22 - f21 - f12 + f11
    b, c = f21 - f11 - d, f12 - f11 - d
    return f11 - b - c - d + b * layers + c * microbatches + d * layers * microbatches


def _numbers(facts: StepFacts) -> dict[str, float]:
    """The extrapolated quantities of one trace, by name."""
    numbers = {"flops": facts.flops, "inputs": facts.memory.inputs}
    for use in facts.collectives:
        key = f"{use.kind} over {use.dims}"
        numbers[f"{key}: count"] = use.count
        numbers[f"{key}: elements"] = -1 if use.elements is None else use.elements
        numbers[f"{key}: bytes"] = -1 if use.bytes is None else use.bytes
    return numbers


def uniform_layers(cfg: TrainConfig) -> bool:
    """Whether every layer of ``cfg``'s model is built alike (all dense or all MoE)."""
    return len(set(cfg.model.moe_layers)) == 1


def dry_run_facts(cfg: TrainConfig, world_size: int, rank: int = 0, expert_load: float = 1.0) -> StepFacts:
    """The step facts of ``cfg`` on ``rank``: traced whole when it is short or its layers differ,
    else extrapolated from small copies (module docstring); the experts' tokens evenly shared, or
    each rank's exchanged rows at ``expert_load`` times that share
    (``lmfunc.train.run_step.even_expert_share``)."""
    with even_expert_share(cfg, cfg.parallel.sizes(world_size), expert_load):
        return _dry_run_facts(cfg, world_size, rank)


def _dry_run_facts(cfg: TrainConfig, world_size: int, rank: int) -> StepFacts:
    layers, microbatches = cfg.model.num_layers, batch_plan(cfg, world_size).num_microbatches_at(0)
    if layers * microbatches <= WHOLE_STEP_LIMIT or not uniform_layers(cfg):
        return step_facts(trace_rank(cfg, world_size, rank),
                          f"the whole step traced ({layers} layers, {microbatches} microbatches)")
    began = time.perf_counter()
    traces: dict[tuple[int, int], StepFacts] = {}

    def traced(point: tuple[int, int]) -> StepFacts:
        if point not in traces:
            traces[point] = step_facts(trace_rank(shrunk(cfg, world_size, *point), world_size, rank))
        return traces[point]

    numbers = {point: _numbers(traced(point)) for point in (*FIT_POINTS, CHECK_POINT)}
    check = numbers[CHECK_POINT]
    for name in check:
        if not all(name in numbers[p] for p in FIT_POINTS):
            raise ConfigError(f"dry run: '{name}' appears only in the deeper trace, so the layers' graphs differ; "
                              "the step cannot be extrapolated from small copies")
        predicted = _bilinear({p: numbers[p][name] for p in FIT_POINTS}, *CHECK_POINT)
        if predicted != check[name]:
            raise ConfigError(f"dry run: at {CHECK_POINT[0]} layers and {CHECK_POINT[1]} microbatches '{name}' is "
                              f"{check[name]:,.0f}, not the {predicted:,.0f} that 1 and 2 layers and microbatches "
                              "predict: the layers' or microbatches' graphs are not all alike")
    at = lambda name: round(_bilinear({p: numbers[p][name] for p in FIT_POINTS}, layers, microbatches))  # noqa: E731
    base = traces[CHECK_POINT]
    uses = []
    for use in base.collectives:
        key = f"{use.kind} over {use.dims}"
        elements, nbytes = at(f"{key}: elements"), at(f"{key}: bytes")
        uses.append(CollectiveUse(use.kind, use.dims, at(f"{key}: count"), None if use.elements is None else elements,
                                  None if use.bytes is None else nbytes))
    peak, how = _peak(traced, layers, microbatches)
    inputs = at("inputs")
    memory = MemoryReport(peak, inputs, f"{base.memory.at_node} of the 3-layer, 3-microbatch trace",
                          base.memory.largest, one_graph_terms(peak, inputs))
    description = (f"extrapolated to {layers} layers and {microbatches} microbatches from traces of 1-2 layers x 1-2 "
                   f"microbatches, checked exactly against a trace of 3 x 3 (collectives, FLOPs, inputs); {how}")
    return StepFacts(uses, at("flops"), base.flops_estimated_ops, memory, base.dims_ranks, rank,
                     time.perf_counter() - began, description)


def _peak(traced, layers: int, microbatches: int) -> tuple[int, str]:
    """The step's peak memory at ``layers`` and ``microbatches``, and how it was obtained: affine in
    the depth at ``min(microbatches, 3)`` microbatches (fitted at ``PEAK_FIT_DEPTHS`` layers, held
    to the ``PEAK_CHECK_DEPTH``-layer trace within ``MEMORY_TOLERANCE``; a step no deeper than the
    fit's depths is traced at its depth); beyond 3 microbatches, what the peak still grew from 2 to 3
    microbatches is added for each further one (an upper bound), unless it stopped growing."""
    m = min(microbatches, 3)
    if layers <= max(PEAK_FIT_DEPTHS):
        peak = traced((layers, m)).memory.peak
        if microbatches <= 3:
            return peak, f"peak memory of the {layers}-layer trace at {m} microbatches"
        how = f"peak memory of the {layers}-layer trace at 3 microbatches"
        per_microbatch = peak - traced((layers, 2)).memory.peak
    else:
        low, high = PEAK_FIT_DEPTHS
        peaks = {n: traced((n, m)).memory.peak for n in (*PEAK_FIT_DEPTHS, PEAK_CHECK_DEPTH)}
        slope = (peaks[high] - peaks[low]) / (high - low)
        predicted = round(peaks[low] + (PEAK_CHECK_DEPTH - low) * slope)
        if abs(predicted - peaks[PEAK_CHECK_DEPTH]) > MEMORY_TOLERANCE * peaks[PEAK_CHECK_DEPTH]:
            raise ConfigError(f"dry run: the peak memory at {PEAK_CHECK_DEPTH} layers ({peaks[PEAK_CHECK_DEPTH]:,} "
                              f"bytes) is not the {predicted:,} that {low} and {high} layers predict (tolerance "
                              f"{MEMORY_TOLERANCE:.0%}): the layers' memory is not alike, so the peak cannot be "
                              "extrapolated")
        peak = round(peaks[low] + (layers - low) * slope)
        how = (f"peak memory affine in the depth at {m} microbatches (fitted at {low} and {high} layers, held to "
               f"the {PEAK_CHECK_DEPTH}-layer trace within {MEMORY_TOLERANCE:.0%})")
        if microbatches <= 3:
            return peak, how
        growth = [peaks[n] - traced((n, 2)).memory.peak for n in PEAK_FIT_DEPTHS]
        per_microbatch = round(growth[0] + (layers - low) * (growth[1] - growth[0]) / (high - low))
    if per_microbatch <= MEMORY_TOLERANCE * peak:
        return peak, how + "; it no longer grows from 2 to 3 microbatches"
    return (peak + (microbatches - 3) * per_microbatch,
            how + f"; it still grew by {per_microbatch / 2**30:.2f} GiB from 2 to 3 microbatches, added for each further "
                  "microbatch (an upper bound)")
