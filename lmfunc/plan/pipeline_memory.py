"""lmfunc's memory prediction for one pipeline rank (``parallel.pp > 1``), from what the pipeline
step (``lmfunc.train.pipeline_step``) holds.

- **state and gradients**: the rank's leaves (``lmfunc.model.stages.rank_params``: its stages'
  layers, the embedding on the first stage, the final norm, output layer and MTP depths on the
  last, the token embedding on both when shared), sharded over the data- and tensor-parallel dims
  by the same rules as without a pipeline. fp32 params and two Adam moments (12 bytes each), and
  fp32 gradients (4 bytes) that accumulate in the stage modules over the step's microbatches, so
  they exist while later microbatches still hold activations.
- **activations in flight**: the schedule decides how many stage-microbatches ("chunks") a rank
  has run forward and not yet backward (``chunks_in_flight``): GPipe all m, 1F1B at most p - r on
  pipeline rank r, the interleaved schedules torch's warm-up count plus one. Each chunk keeps its
  stage's layer values (``layer_kept_bytes``, the MTP depths' on the last stage) and the stage's
  input and output hidden states (the schedule keeps both until the chunk's backward).
- **the output layer's working set** on the last stage, one microbatch at a time (``head_bytes``).
- **the update** runs after the schedule, on the whole gradients, compiled and donated (the
  trainer's ``make_pipeline_train_step(donate_state=True)``): it writes the new params and
  moments into the state's tensors and adds nothing beyond the gradients.

The peak is the state, the compute copies and the gradients plus the schedule's activations in
flight and the output layer.

The zbv and dualpipev schedules are not predicted (their V-shaped order has no count here yet).

Accuracy, measured on the CPU (docs/performance.md): the counts of chunks in flight are exact; the
bytes per chunk fall short, because the compiled stages keep about 1.2x the per-layer values of the
one-graph step (AOTAutograd's partitioner chooses them, not lmfunc's saved-value and recompute
passes). Over GPipe, 1F1B and interleaved 1F1B on pp 2 and 4 the prediction was 19% below to 4%
above the measured step memory; the printout says so (``ACCURACY_NOTE``).
"""

from __future__ import annotations

import math
from typing import Optional

from lmfunc.config.parallel import data_parallel_size
from lmfunc.config.pipeline import PipelineSplit
from lmfunc.config.train import TrainConfig
from lmfunc.model import gpt
from lmfunc.model.stages import rank_params
from lmfunc.parallel.sharding import COMPUTE_RULES, DEFAULT_RULES, Rules, local_shape
from lmfunc.plan.memory import DTYPE_BYTES, MemoryPlan, head_bytes, layer_kept_bytes
from lmfunc.tree import flatten_with_paths

ACCURACY_NOTE = ("pipeline ranks are predicted with the one-graph step's per-layer values; measured on the CPU, the "
                 "compiled stages' step memory was 4% below to 23% above this (docs/performance.md)")


def chunks_in_flight(schedule: str, split: PipelineSplit, microbatches: int, rank: int) -> Optional[int]:
    """The most stage-microbatches pipeline rank ``rank`` holds activations for at once (forward
    run, backward not yet) under torch's ``schedule`` with ``microbatches`` per step; None for the
    schedules not predicted. Interleaved 1F1B warms up with ``(V - 1) x round + 2 (p - 1 - r)``
    forwards and zero bubble with ``(V - 1) x round + (p - 1 - r)`` (torch's ``_get_warmup_ops``;
    a round is ``m // max(1, m // p)`` microbatches), then runs one more before its first backward."""
    p, v, m = split.pp, split.stages_per_rank, microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        per_round = m // max(1, m // p)
        factor = 2 if schedule == "interleaved-1f1b" else 1
        return min(m * v, (v - 1) * per_round + factor * (p - 1 - rank) + 1)
    return None


def _rank_elements(cfg: TrainConfig, split: PipelineSplit, rank: int, sizes: dict[str, int],
                   rules: Rules = DEFAULT_RULES) -> int:
    """Parameter elements of pipeline rank ``rank``'s leaves on one data/tensor-parallel rank, laid out
    by ``rules`` (storage; ``COMPUTE_RULES``: the compute layout)."""
    others = {name: size for name, size in sizes.items() if name != "pp"}
    specs = rank_params(gpt.param_specs(cfg.model), cfg.model, split, rank)
    return sum(math.prod(local_shape(spec.shape, spec.axes, others, rules))
               for _, spec in flatten_with_paths(specs, is_leaf=lambda x: hasattr(x, "axes")))


def _stage_kept_bytes(cfg: TrainConfig, split: PipelineSplit, stage: int, tp: int) -> float:
    """What one microbatch's pass through stage ``stage`` keeps in its layers (``layer_kept_bytes``;
    MoE layers their experts' values): its layers, and on the last stage the MTP depths."""
    m = cfg.model
    layers = [m.moe_layers[i] for i in split.layers[stage]]
    if split.holds_head(stage):
        layers += [m.moe_layers[-1]] * m.mtp_num_layers
    return sum(layer_kept_bytes(cfg, tp, m.recompute_granularity, moe=is_moe) for is_moe in layers)


def predict_pipeline_rank(cfg: TrainConfig, sizes: dict[str, int], rank: int) -> Optional[MemoryPlan]:
    """The peak step memory of pipeline rank ``rank`` (module docstring); None when the schedule is
    not predicted."""
    p, m = cfg.parallel, cfg.model
    split = p.pipeline_split(m.num_layers, sizes["pp"])
    data_parallel = data_parallel_size(sizes)
    microbatches = cfg.run.global_batch_size // (cfg.run.micro_batch_size * data_parallel)
    chunks = chunks_in_flight(p.pp_schedule, split, microbatches, rank)
    if chunks is None:
        return None
    tp = sizes.get("tp", 1)
    compute_bytes = DTYPE_BYTES[cfg.precision.compute_dtype]
    params = _rank_elements(cfg, split, rank, sizes)
    gathered = _rank_elements(cfg, split, rank, sizes, COMPUTE_RULES)
    compute_copies = compute_bytes * gathered if compute_bytes < 4 or gathered != params else 0
    hidden_split = tp if m.sequence_parallel and tp > 1 else 1
    boundary = 2 * cfg.run.micro_batch_size * cfg.data.seq_length * m.hidden_size * compute_bytes / hidden_split
    per_chunk = max(_stage_kept_bytes(cfg, split, s, tp) + boundary for s in split.stages_of_rank(rank))
    activations = int(chunks * per_chunk)
    holds_head = any(split.holds_head(s) for s in split.stages_of_rank(rank))
    head = head_bytes(cfg, tp) if holds_head else 0
    state, grads = 12 * params, 4 * params
    peak = state + compute_copies + grads + activations + head
    note = (f"pipeline rank {rank} of {split.pp}: {p.pp_schedule} holds at most {chunks} stage-microbatches "
            f"in flight ({microbatches} microbatches per step)")
    return MemoryPlan(sizes=dict(sizes), params=params, state=state, grads=grads, compute_copies=compute_copies,
                      activations=activations, scan_gradients=0, head=head, peak=peak, notes=(note, ACCURACY_NOTE),
                      chunks_in_flight=chunks)


def predict_pipeline_memory(cfg: TrainConfig, sizes: dict[str, int]) -> Optional[MemoryPlan]:
    """The prediction of the most-loaded pipeline rank (the largest peak); None when the schedule is
    not predicted."""
    plans = [predict_pipeline_rank(cfg, sizes, rank) for rank in range(sizes["pp"])]
    if any(plan is None for plan in plans):
        return None
    return max(plans, key=lambda plan: plan.peak)
