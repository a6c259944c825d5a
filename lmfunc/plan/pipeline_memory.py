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
  output hidden states until the chunk's backward (its input is one of the receive buffers).
- **the output layer's working set** on the last stage, one microbatch at a time (``head_bytes``).
- **the receive buffers**: torch's stages allocate, at the first step and for good, a buffer for
  every microbatch's received activations and one for its received gradients
  (``receive_buffer_bytes``); Megatron receives into buffers as it goes.
- **the update** runs after the schedule, on the whole gradients, compiled and donated (the
  trainer's ``make_pipeline_train_step(donate_state=True)``): it writes the new params and
  moments into the state's tensors and adds nothing beyond the gradients.

The peak is the state, the compute copies and the gradients plus the schedule's activations in
flight, the output layer and the receive buffers.

The zbv and dualpipev schedules are not predicted (their V-shaped order has no count here yet).

Accuracy (docs/performance.md, docs/scale_out.md): the counts of chunks in flight and the receive
buffers are exact; the bytes per chunk are the one-graph step's per-layer values, which the
compiled stages do not keep exactly (AOTAutograd's partitioner chooses their saved values, not
lmfunc's saved-value and recompute passes): about 1.25x of them in fp32 without recompute, where
over GPipe, 1F1B and interleaved 1F1B on pp 2 and 4 (CPU) the prediction was 19% below to 0.3%
above the measured step memory, and 0.9x in bf16 with selective recompute beside tp and SP, where
Llama-3-70B's dry run on 512 ranks reads 6-10% under it; the printout says so (``ACCURACY_NOTE``).
"""

from __future__ import annotations

import math
from typing import Optional

from lmfunc.config.parallel import data_parallel_size
from lmfunc.config.pipeline import PipelineSplit
from lmfunc.config.train import TrainConfig
from lmfunc.model import gpt
from lmfunc.model.stages import rank_params, stage_params
from lmfunc.parallel.sharding import COMPUTE_RULES, DEFAULT_RULES, Rules, local_shape
from lmfunc.plan.memory import DTYPE_BYTES, MemoryPlan, head_bytes, layer_kept_bytes
from lmfunc.tree import flatten_with_paths

ACCURACY_NOTE = ("pipeline ranks are predicted with the one-graph step's per-layer values; the compiled stages' step "
                 "memory measured 0.3% below to 23% above this on the CPU in fp32 (docs/performance.md), and "
                 "their dry run reads 6-10% below it for Llama-3-70B in bf16 (docs/scale_out.md)")


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


def _elements(specs, sizes: dict[str, int], rules: Rules = DEFAULT_RULES) -> int:
    """Parameter elements of the leaves ``specs`` on one data/tensor-parallel rank, laid out by
    ``rules`` (storage; ``COMPUTE_RULES``: the compute layout)."""
    others = {name: size for name, size in sizes.items() if name != "pp"}
    return sum(math.prod(local_shape(spec.shape, spec.axes, others, rules))
               for _, spec in flatten_with_paths(specs, is_leaf=lambda x: hasattr(x, "axes")))


def _rank_elements(cfg: TrainConfig, split: PipelineSplit, rank: int, sizes: dict[str, int],
                   rules: Rules = DEFAULT_RULES) -> int:
    """Parameter elements of pipeline rank ``rank``'s leaves (``_elements``)."""
    return _elements(rank_params(gpt.param_specs(cfg.model), cfg.model, split, rank), sizes, rules)


def _stage_compute_copy_bytes(cfg: TrainConfig, split: PipelineSplit, rank: int, sizes: dict[str, int]) -> int:
    """The largest of rank ``rank``'s stages' compute copies (its leaves gathered over the
    data-parallel dims and cast to the compute dtype): each stage call makes its own, and the
    compiled stages keep none of them for the backward (``lmfunc.compiler.regather``), which makes
    them again; 0 when the stages compute on the stored fp32 shards themselves."""
    compute_bytes = DTYPE_BYTES[cfg.precision.compute_dtype]
    specs = gpt.param_specs(cfg.model)
    largest = 0
    for stage in split.stages_of_rank(rank):
        leaves = stage_params(specs, cfg.model, split, stage)
        gathered = _elements(leaves, sizes, COMPUTE_RULES)
        if compute_bytes < 4 or gathered != _elements(leaves, sizes):
            largest = max(largest, compute_bytes * gathered)
    return largest


def _stage_kept_bytes(cfg: TrainConfig, split: PipelineSplit, stage: int, tp: int) -> float:
    """What one microbatch's pass through stage ``stage`` keeps in its layers (``layer_kept_bytes``;
    MoE layers their experts' values): its layers, and on the last stage the MTP depths."""
    m = cfg.model
    layers = [m.moe_layers[i] for i in split.layers[stage]]
    if split.holds_head(stage):
        layers += [m.moe_layers[-1]] * m.mtp_num_layers
    return sum(layer_kept_bytes(cfg, tp, m.recompute_granularity, moe=is_moe) for is_moe in layers)


def hidden_state_bytes(cfg: TrainConfig, sizes: dict[str, int]) -> int:
    """Bytes of the hidden states ``[B, S', h]`` one microbatch passes between two stages on one rank
    (``pipeline_stages.StageShapes``): the compute dtype, ``S' = S / cp``, and ``/ tp`` with sequence
    parallelism."""
    m, tp = cfg.model, sizes.get("tp", 1)
    hidden_split = tp if m.sequence_parallel and tp > 1 else 1
    tokens = cfg.run.micro_batch_size * (cfg.data.seq_length // sizes.get("cp", 1)) // hidden_split
    return tokens * m.hidden_size * DTYPE_BYTES[cfg.precision.compute_dtype]


def receive_buffer_bytes(cfg: TrainConfig, split: PipelineSplit, sizes: dict[str, int], rank: int,
                         microbatches: int) -> int:
    """The buffers pipeline rank ``rank``'s stages receive into: torch's ``PipelineStage`` allocates,
    at the step's first run and for good, one hidden state per microbatch for each of its stages
    that receives activations (all but the embedding's) and one for each that receives gradients
    (all but the output layer's)."""
    receiving = sum((not split.holds_embedding(s)) + (not split.holds_head(s)) for s in split.stages_of_rank(rank))
    return receiving * microbatches * hidden_state_bytes(cfg, sizes)


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
    params = _rank_elements(cfg, split, rank, sizes)
    compute_copies = _stage_compute_copy_bytes(cfg, split, rank, sizes)
    output = hidden_state_bytes(cfg, sizes)
    per_chunk = max(_stage_kept_bytes(cfg, split, s, tp) + (0 if split.holds_head(s) else output)
                    for s in split.stages_of_rank(rank))
    activations = int(chunks * per_chunk)
    holds_head = any(split.holds_head(s) for s in split.stages_of_rank(rank))
    head = head_bytes(cfg, tp) if holds_head else 0
    receive = receive_buffer_bytes(cfg, split, sizes, rank, microbatches)
    state, grads = 12 * params, 4 * params
    peak = state + compute_copies + grads + activations + head + receive
    note = (f"pipeline rank {rank} of {split.pp}: {p.pp_schedule} holds at most {chunks} stage-microbatches "
            f"in flight ({microbatches} microbatches per step)")
    return MemoryPlan(sizes=dict(sizes), params=params, state=state, grads=grads, compute_copies=compute_copies,
                      activations=activations, scan_gradients=0, head=head, peak=peak, notes=(note, ACCURACY_NOTE),
                      chunks_in_flight=chunks, receive_buffers=receive)


def predict_pipeline_memory(cfg: TrainConfig, sizes: dict[str, int]) -> Optional[MemoryPlan]:
    """The prediction of the most-loaded pipeline rank (the largest peak); None when the schedule is
    not predicted."""
    plans = [predict_pipeline_rank(cfg, sizes, rank) for rank in range(sizes["pp"])]
    if any(plan is None for plan in plans):
        return None
    return max(plans, key=lambda plan: plan.peak)
