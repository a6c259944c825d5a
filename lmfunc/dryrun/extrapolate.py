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
from lmfunc.dryrun.graph_report import CollectiveUse, MemoryReport, StepFacts, step_facts
from lmfunc.plan.memory import STATE_TERM, WORKING_TERM
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
    memory, how = _extrapolated_memory(traced, layers, microbatches, at("inputs"))
    description = (f"extrapolated to {layers} layers and {microbatches} microbatches from traces of 1-2 layers x 1-2 "
                   f"microbatches, checked exactly against a trace of 3 x 3 (collectives, FLOPs, inputs); {how}")
    return StepFacts(uses, at("flops"), base.flops_estimated_ops, memory, base.dims_ranks, rank,
                     time.perf_counter() - began, description)


def _peak_weights(traced, layers: int, microbatches: int) -> tuple[dict[tuple[int, int], float], str]:
    """The step's peak memory at ``layers`` and ``microbatches`` as a weighted sum of traces' peaks
    ((layers, microbatches) -> weight), and how it was obtained: affine in the depth at
    ``min(microbatches, 3)`` microbatches (fitted at ``PEAK_FIT_DEPTHS`` layers, held to the
    ``PEAK_CHECK_DEPTH``-layer trace within ``MEMORY_TOLERANCE``; a step no deeper than the fit's
    depths is traced at its depth); beyond 3 microbatches, what the peak still grew from 2 to 3
    microbatches is added for each further one (an upper bound), unless it stopped growing. The
    same weights split the peak into its terms."""
    m = min(microbatches, 3)
    peak_of = lambda point: traced(point).memory.peak  # noqa: E731
    if layers <= max(PEAK_FIT_DEPTHS):
        weights = {(layers, m): 1.0}
        if microbatches <= 3:
            return weights, f"peak memory of the {layers}-layer trace at {m} microbatches"
        how = f"peak memory of the {layers}-layer trace at 3 microbatches"
        growth = {(layers, 3): 1.0, (layers, 2): -1.0}
    else:
        low, high = PEAK_FIT_DEPTHS
        peaks = {n: peak_of((n, m)) for n in (*PEAK_FIT_DEPTHS, PEAK_CHECK_DEPTH)}
        slope = (peaks[high] - peaks[low]) / (high - low)
        predicted = round(peaks[low] + (PEAK_CHECK_DEPTH - low) * slope)
        if abs(predicted - peaks[PEAK_CHECK_DEPTH]) > MEMORY_TOLERANCE * peaks[PEAK_CHECK_DEPTH]:
            raise ConfigError(f"dry run: the peak memory at {PEAK_CHECK_DEPTH} layers ({peaks[PEAK_CHECK_DEPTH]:,} "
                              f"bytes) is not the {predicted:,} that {low} and {high} layers predict (tolerance "
                              f"{MEMORY_TOLERANCE:.0%}): the layers' memory is not alike, so the peak cannot be "
                              "extrapolated")
        along = (layers - low) / (high - low)
        weights = {(low, m): 1.0 - along, (high, m): along}
        how = (f"peak memory affine in the depth at {m} microbatches (fitted at {low} and {high} layers, held to "
               f"the {PEAK_CHECK_DEPTH}-layer trace within {MEMORY_TOLERANCE:.0%})")
        if microbatches <= 3:
            return weights, how
        growth = {(low, 3): 1.0 - along, (low, 2): along - 1.0, (high, 3): along, (high, 2): -along}
    peak = sum(w * peak_of(p) for p, w in weights.items())
    per_microbatch = sum(w * peak_of(p) for p, w in growth.items())
    if per_microbatch <= MEMORY_TOLERANCE * peak:
        return weights, how + "; it no longer grows from 2 to 3 microbatches"
    for point, weight in growth.items():
        weights[point] = weights.get(point, 0.0) + (microbatches - 3) * weight
    return weights, how + (f"; it still grew by {per_microbatch / 2**30:.2f} GiB from 2 to 3 microbatches, added for "
                           "each further microbatch (an upper bound)")


def _extrapolated_memory(traced, layers: int, microbatches: int, inputs: int) -> tuple[MemoryReport, str]:
    """The step's peak memory (``_peak_weights``) and its terms, each the same weighted sum of the
    traces' terms (the working set takes the rounding, so that they add up to the peak)."""
    weights, how = _peak_weights(traced, layers, microbatches)
    peak = round(sum(w * traced(p).memory.peak for p, w in weights.items()))
    base = traced(CHECK_POINT).memory
    terms = {name: 0.0 for name, _ in base.terms}
    for point, weight in weights.items():
        for name, size in traced(point).memory.terms:
            terms[name] = terms.get(name, 0.0) + weight * size
    split = [(name, inputs if name == STATE_TERM else round(size)) for name, size in terms.items() if name != WORKING_TERM]
    split.append((WORKING_TERM, peak - sum(size for _, size in split)))
    return MemoryReport(peak, inputs, f"{base.at_node} of the 3-layer, 3-microbatch trace", base.largest, tuple(split)), how
