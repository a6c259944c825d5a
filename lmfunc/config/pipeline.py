"""How a pipeline-parallel run splits the model: which layers each stage holds, which stages each
rank runs, and what each schedule allows (pure functions of the config; nothing here talks to
torch.distributed).

Stages are numbered ``0 .. S-1`` in model order, ``S = pp x virtual_stages``. Stage 0 also holds
the embedding; stage ``S-1`` the final norm, the output layer and the MTP depths. Layers keep their
model-wide index (``layers.<i>``), so a checkpoint is the same tree on every pp size.

- **Layer split.** Without overrides every stage holds ``num_layers / S`` consecutive layers
  (Megatron's rule: ``num_layers`` divisible by ``pp x virtual_stages``). With
  ``first_stage_layers`` and/or ``last_stage_layers`` (Megatron's
  ``--decoder-first/last-pipeline-num-layers``, for stages that also carry the embedding or the
  output layer) those stages hold that many, possibly 0, and the layers left are split evenly over
  the other stages. Here the first and last *stage* are those of the whole pipeline, virtual
  stages included.
- **Stages of a rank.** Loop placement (GPipe, 1F1B, interleaved 1F1B, zero bubble): rank ``r``
  runs stages ``r, r + pp, r + 2 pp, ...`` (Megatron's interleaving). V placement (ZBV,
  DualPipeV; two stages per rank): rank ``r`` runs stages ``r`` and ``2 pp - 1 - r``, so the first
  and last stage share rank 0.
- **Microbatches** (``m`` per data-parallel rank and step): 1F1B and DualPipeV need
  ``m >= S`` (torch's rule); interleaved 1F1B and zero bubble need ``m`` a multiple of ``pp``
  (Megatron's rule for interleaving); GPipe takes any ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmfunc.config.model import ConfigError

SCHEDULES = {
    # name: (torch.distributed.pipelining class, stages per rank: None = virtual_stages, placement)
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", None, "loop"),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", None, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
"""Schedule names of ``--parallel.pp-schedule`` and how each places its stages."""


@dataclass(frozen=True)
class PipelineSplit:
    """The stages of a pipeline: ``layers[s]`` are the model-wide layer indices of stage ``s``."""

    pp: int
    stages_per_rank: int
    placement: str
    """'loop' or 'v' (see the module docstring)."""
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stage indices pipeline rank ``rank`` runs, in the order torch's schedules take them."""
        if not 0 <= rank < self.pp:
            raise ValueError(f"pipeline rank {rank} is outside 0..{self.pp - 1}")
        if self.placement == "v":
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(rank + chunk * self.pp for chunk in range(self.stages_per_rank))

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that runs stage ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        if self.placement == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def holds_embedding(self, stage: int) -> bool:
        return stage == 0

    def holds_head(self, stage: int) -> bool:
        """The final norm, the output layer, the loss and the MTP depths."""
        return stage == self.num_stages - 1


def split_layers(num_layers: int, num_stages: int, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None) -> tuple[tuple[int, ...], ...]:
    """Consecutive model-wide layer indices of each of ``num_stages`` stages (module docstring's
    rule); errors name the numbers and the flags to change."""
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got {num_stages}")
    for name, value in (("parallel.pp_first_stage_layers", first_stage_layers),
                        ("parallel.pp_last_stage_layers", last_stage_layers)):
        if value is not None and not 0 <= value <= num_layers:
            raise ConfigError(f"{name} ({value}) must be between 0 and model.num_layers ({num_layers})")
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % num_stages:
            raise ConfigError(
                f"model.num_layers ({num_layers}) is not divisible by the pipeline's stages (parallel.pp x "
                f"parallel.virtual_stages = {num_stages}); change the sizes or give an uneven split with "
                "--parallel.pp-first-stage-layers / --parallel.pp-last-stage-layers")
        counts = [num_layers // num_stages] * num_stages
    else:
        if num_stages == 1:
            raise ConfigError("parallel.pp_first_stage_layers / pp_last_stage_layers need more than one pipeline stage")
        ends = [first_stage_layers, last_stage_layers]
        middle_stages = num_stages - sum(1 for value in ends if value is not None)
        rest = num_layers - sum(value for value in ends if value is not None)
        if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages):
            given = ", ".join(f"{name} {value}" for name, value in (("first stage", first_stage_layers),
                                                                    ("last stage", last_stage_layers)) if value is not None)
            raise ConfigError(
                f"model.num_layers ({num_layers}) with {given} leaves {rest} layers for the other {middle_stages} "
                f"stage(s), which must split them evenly; change --parallel.pp-first-stage-layers / "
                "--parallel.pp-last-stage-layers")
        even = rest // middle_stages if middle_stages else 0
        counts = [even] * num_stages
        if first_stage_layers is not None:
            counts[0] = first_stage_layers
        if last_stage_layers is not None:
            counts[-1] = last_stage_layers
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return tuple(tuple(range(start, start + count)) for start, count in zip(starts, counts))


def pipeline_split(num_layers: int, pp: int, schedule: str, virtual_stages: Optional[int] = None,
                   first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> PipelineSplit:
    """The ``PipelineSplit`` of a run, after checking the schedule against the stage counts."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    _, fixed, placement = SCHEDULES[schedule]
    if virtual_stages is not None and virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages must be a positive integer, got {virtual_stages}")
    if fixed is None:
        per_rank = virtual_stages or 1
    else:
        if virtual_stages is not None and virtual_stages != fixed:
            raise ConfigError(f"parallel.pp_schedule {schedule} runs {fixed} stage(s) per rank, but "
                              f"parallel.virtual_stages is {virtual_stages}; drop --parallel.virtual-stages or choose "
                              "interleaved-1f1b / zero-bubble for virtual stages")
        per_rank = fixed
    layers = split_layers(num_layers, pp * per_rank, first_stage_layers, last_stage_layers)
    return PipelineSplit(pp=pp, stages_per_rank=per_rank, placement=placement, layers=layers)


SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")
"""Schedules that split each backward into an input-gradient and a weight-gradient pass."""


def check_schedule_model(schedule: str, tie_embeddings: bool, mtp_num_layers: int, compiled: bool) -> None:
    """Reject model settings a schedule cannot run: torch's split backward (``SPLIT_BACKWARD``)
    computes each weight gradient from the nodes where it joins the input's path, one parameter
    group after another, each freeing its part of the graph. With tied embeddings and MTP the last
    stage reads the token embedding twice (the MTP lookup and the output layers), and in an eager
    stage that embedding's group evidently runs through nodes another group has freed: torch 2.13 stops with
    "Trying to backward through the graph a second time". A compiled stage is one autograd node,
    so all its weights form one group and it runs."""
    if schedule in SPLIT_BACKWARD and tie_embeddings and mtp_num_layers > 0 and not compiled:
        raise ConfigError(f"parallel.pp_schedule {schedule} splits the backward into input and weight passes, which "
                          "torch 2.13 cannot run on an eager stage that reads the tied token embedding twice (MTP "
                          f"with model.mtp_num_layers = {mtp_num_layers} and tied embeddings); compile the stages "
                          "(--run.compile), untie the embeddings (--model.no-tie-embeddings), turn MTP off, or choose "
                          "gpipe, 1f1b or interleaved-1f1b")


def check_microbatches(schedule: str, split: PipelineSplit, microbatches: int) -> None:
    """Reject a number of microbatches per step that ``schedule`` cannot run on ``split``."""
    if microbatches < 1:
        raise ConfigError(f"a pipeline step needs at least one microbatch, got {microbatches}")
    hint = ("set --run.global-batch-size to micro batch x data-parallel size x a number of microbatches that "
            "fits")
    if schedule in ("1f1b", "dualpipev") and microbatches < split.num_stages:
        raise ConfigError(f"parallel.pp_schedule {schedule} needs at least as many microbatches per step as stages "
                          f"({split.num_stages}), got {microbatches}; {hint}")
    if schedule in ("interleaved-1f1b", "zero-bubble") and microbatches % split.pp:
        raise ConfigError(f"parallel.pp_schedule {schedule} needs the microbatches per step ({microbatches}) to be a "
                          f"multiple of parallel.pp ({split.pp}); {hint}")
