"""The pipeline bubble, measured against theory, and the P2P messages of a step.

    torchrun --standalone --nproc-per-node P -m experiments.bench.pipeline \\
        [--schedule 1f1b] [--virtual-stages V] [--microbatches 4 8 16] [--timeline]

Each rank trains ``make_pipeline_train_step`` (donating its state, as the trainer does; eager
stages unless ``--compile``, the times after warm-up steps, so they are the stages' compute, not
compilation) on a fixed workload and times, per step, the stages' compute actions (torch's
``forward_one_chunk``, ``backward_one_chunk`` and, for zero bubble, ``backward_weight_one_chunk``):
busy = their sum; idle = the schedule's wall time (``schedule.step``) - busy: waiting for another
stage, posting and waiting for P2P, the schedule's own bookkeeping. The bubble fraction of a rank
is idle / schedule time; theory (GPipe, 1F1B) is (p - 1) / (m + p - 1) and, interleaved over V
virtual stages, that divided by V; zero bubble about 0 where it applies. The update (clipping,
AdamW) runs after the schedule and is reported apart.

P2P: the send operations the stages post per step (``get_fwd_send_ops``/``get_bwd_send_ops``),
summed over ranks, against 2 m (S - 1): each of the S - 1 stage boundaries sends one activation
forward and one gradient back per microbatch (less the boundaries inside a rank: V schedules).

Memory: the most microbatches a rank holds activations for at once (forward run, backward not
yet), from the order of its actions: GPipe m, 1F1B at most p, next to ``lmfunc.plan``'s count
(``chunks_in_flight``). ``--memory`` also measures each rank's step memory: the bytes its state,
batch and stages' receive buffers hold plus the allocator's peak during one more step
(``allocator_peak_bytes``), next to
``lmfunc.plan``'s prediction for that rank (``predict_pipeline_rank``); ``--compile`` compiles
the stages and the update, as the trainer does (the prediction models compiled stages).

``--timeline`` prints the order of one step's actions per rank with their start times (ms).
``--json PATH`` writes, for the last ``--microbatches`` value, each rank's step memory (as
``--memory`` measures it) and the collectives and point-to-point messages of one more step, by
kind: (count, elements) (``experiments.bench.comm.step_collectives_and_p2p``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Optional

import torch
import torch.distributed as dist

from experiments.bench.comm import step_collectives_and_p2p
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.config.pipeline import check_microbatches, pipeline_split
from lmfunc.metrics import allocator_peak_bytes
from lmfunc.optim import adamw
from lmfunc.plan.pipeline_memory import chunks_in_flight, predict_pipeline_rank
from lmfunc.train import TrainState
from lmfunc.train.pipeline_step import make_pipeline_train_step
from lmfunc.model.stages import rank_params
from lmfunc.train.__main__ import exit_without_finalizing
from tests.helpers import lm_batch

WORKLOAD = {"num_layers": 8, "hidden_size": 128, "seq": 128, "micro_batch": 2}
"""The ``tiny`` preset widened to 128 with 8 layers; each microbatch 2 sequences of 128 tokens."""

ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def theory(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """The bubble fraction of the schedule (module docstring)."""
    if schedule in ("zero-bubble", "zbv", "dualpipev"):
        return 0.0
    return (pp - 1) / (microbatches + pp - 1) / virtual


class _Recorder:
    """Wraps the compute and send methods of this rank's ``PipelineStage`` objects: the time spent
    in compute, the sends posted and (for the timeline) each action's start and end."""

    def __init__(self) -> None:
        self.busy, self.scheduled, self.sends, self.events, self.origin = 0.0, 0.0, 0, [], 0.0

    def reset(self) -> None:
        self.busy, self.scheduled, self.sends, self.events, self.origin = 0.0, 0.0, 0, [], time.perf_counter()

    def wrap_schedule(self, schedule) -> None:
        method = schedule.step

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.scheduled += time.perf_counter() - began

        schedule.step = timed

    def wrap(self, stage) -> None:
        for name, letter in ACTIONS.items():
            method = getattr(stage, name)

            def timed(*args, _method=method, _letter=letter, **kwargs):
                began = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    ended = time.perf_counter()
                    self.busy += ended - began
                    self.events.append((f"{_letter}{stage.stage_index}", began - self.origin, ended - self.origin))

            setattr(stage, name, timed)
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            method = getattr(stage, name)

            def counted(*args, _method=method, **kwargs):
                ops = _method(*args, **kwargs)
                self.sends += len(ops)
                return ops

            setattr(stage, name, counted)


def _most_in_flight(events: list) -> int:
    """The most microbatches whose forward a rank has run and whose backward it has not (summed
    over its stages): the activations it holds at once, in microbatches."""
    count = most = 0
    for name, _, _ in sorted(events, key=lambda event: event[1]):
        count += {"F": 1, "B": -1}.get(name[0], 0)
        most = max(most, count)
    return most


def _stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _train_config(cfg, schedule: str, pp: int, virtual: int, microbatches: int):
    """The workload as the ``TrainConfig`` ``lmfunc.plan`` predicts from."""
    from lmfunc.config.train import DataConfig, ParallelConfig, RunConfig, TrainConfig

    w = WORKLOAD
    return TrainConfig(model=cfg, data=DataConfig(seq_length=w["seq"]),
                       run=RunConfig(micro_batch_size=w["micro_batch"], global_batch_size=w["micro_batch"] * microbatches),
                       parallel=ParallelConfig(pp=pp, pp_schedule=schedule, virtual_stages=virtual if virtual > 1 else None))


def held_receive_buffer_bytes(stages) -> int:
    """Bytes of the buffers torch's ``stages`` receive activations and gradients into: one per
    microbatch each, allocated at the schedule's first step and kept."""
    infos = [info for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)
             for chunk in table.values() for info in chunk]
    return sum(info.buffer.numel() * info.buffer.element_size() for info in infos
               if isinstance(info.buffer, torch.Tensor))


def _step_memory(step, state, batch) -> tuple:
    """(state, bytes the state, the batch and the stages' receive buffers hold, the allocator's peak
    above them during one step)."""
    held = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves((state, batch))
               if isinstance(t, torch.Tensor)) + held_receive_buffer_bytes(_stages(step.schedule()))
    (state, _), peak = allocator_peak_bytes(lambda: step(state, batch))
    return state, held, peak


def measure(schedule_name: str, virtual: int, microbatches: int, steps: int, timeline: bool, memory: bool = False,
            compile: bool = False, json_path: Optional[str] = None) -> None:
    rank, pp = dist.get_rank(), dist.get_world_size()
    w = WORKLOAD
    split = pipeline_split(w["num_layers"], pp, schedule_name, virtual if virtual > 1 else None)
    check_microbatches(schedule_name, split, microbatches)
    cfg = dataclasses.replace(model_preset("tiny", num_layers=w["num_layers"], hidden_size=w["hidden_size"]),
                              tie_embeddings=False, scan_layers=False, max_position_embeddings=w["seq"])
    tx = adamw(1e-3)
    step = make_pipeline_train_step(cfg, tx, split, schedule_name, microbatches, compile=compile, donate_state=True)
    state = TrainState.create(rank_params(model.init(cfg, seed=0), cfg, split, rank), tx)
    batch = lm_batch(cfg.vocab_size, microbatches, w["micro_batch"], w["seq"], seed=0)
    recorder, wrapped = _Recorder(), False
    fractions, busy_ms, step_ms, schedule_ms, sends = [], [], [], [], []
    for i in range(steps + 2):
        dist.barrier()
        recorder.reset()
        began = time.perf_counter()
        state, metrics = step(state, batch)
        float(metrics["loss"])
        elapsed = time.perf_counter() - began
        if not wrapped:  # the first step builds the schedule: wrap its stages for the next ones
            for stage in _stages(step.schedule()):
                recorder.wrap(stage)
            recorder.wrap_schedule(step.schedule())
            wrapped = True
            continue
        if i < 2:
            continue
        fractions.append(1 - recorder.busy / recorder.scheduled)
        busy_ms.append(1e3 * recorder.busy)
        step_ms.append(1e3 * elapsed)
        schedule_ms.append(1e3 * recorder.scheduled)
        sends.append(recorder.sends)
    held = peak = 0
    if memory:
        state, held, peak = _step_memory(step, state, batch)
    all_sent = [None] * pp
    if json_path:
        dist.all_gather_object(all_sent, step_collectives_and_p2p(lambda: step(state, batch)))
    mine = torch.tensor([sum(fractions) / len(fractions), sum(busy_ms) / len(busy_ms), sum(step_ms) / len(step_ms),
                         float(sends[-1]), sum(schedule_ms) / len(schedule_ms), float(held), float(peak)],
                        dtype=torch.float64)
    gathered = [torch.zeros(7, dtype=torch.float64) for _ in range(pp)]
    dist.all_gather(gathered, mine)
    events = [None] * pp
    dist.all_gather_object(events, recorder.events)
    if rank != 0:
        return
    expected_sends = 2 * microbatches * (split.num_stages - 1)
    if split.placement == "v":
        expected_sends -= 2 * microbatches * sum(1 for r in range(pp) for s in split.stages_of_rank(r)
                                                 if s + 1 < split.num_stages and split.rank_of_stage(s + 1) == r)
    mean_fraction = sum(float(g[0]) for g in gathered) / pp
    print(f"{schedule_name:17s} pp {pp} V {max(virtual, 1)} m {microbatches:2d} | step "
          f"{max(float(g[2]) for g in gathered):7.1f} ms, schedule {max(float(g[4]) for g in gathered):7.1f} ms"
          f" | busy per rank "
          + " ".join(f"{float(g[1]):6.1f}" for g in gathered)
          + f" ms | bubble measured {mean_fraction:.3f} (per rank "
          + " ".join(f"{float(g[0]):.3f}" for g in gathered)
          + f") theory {theory(schedule_name, pp, max(virtual, 1), microbatches):.3f} | sends "
          f"{int(sum(float(g[3]) for g in gathered))} expected {expected_sends}", flush=True)
    in_flight = [_most_in_flight(rank_events) for rank_events in events]
    planned = [chunks_in_flight(schedule_name, split, microbatches, r) for r in range(pp)]
    print(f"  microbatches in flight (forward done, backward not yet), most per rank: {in_flight}, "
          f"lmfunc.plan {planned}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"ranks": [{"memory_bytes": float(g[5]) + float(g[6]), "collectives": all_sent[r]}
                                 for r, g in enumerate(gathered)]}, f)
    if memory:
        train_cfg = _train_config(cfg, schedule_name, pp, virtual, microbatches)
        for r, g in enumerate(gathered):
            measured = float(g[5]) + float(g[6])
            plan = predict_pipeline_rank(train_cfg, {"pp": pp}, r)
            predicted = f"{plan.peak / 2**20:.2f} MiB ({100 * (plan.peak / measured - 1):+.1f}%)" if plan else "-"
            print(f"  rank {r} step memory: measured {measured / 2**20:.2f} MiB (state, batch, receive buffers "
                  f"{float(g[5]) / 2**20:.2f} + step peak {float(g[6]) / 2**20:.2f}), lmfunc.plan {predicted}")
    if timeline:
        for r, rank_events in enumerate(events):
            print(f"  rank {r}: " + " ".join(f"{name}@{1e3 * start:.0f}" for name, start, _ in rank_events))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for m in args.microbatches:
        measure(args.schedule, args.virtual_stages, m, args.steps, args.timeline, args.memory, args.compile, args.json)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing()  # gloo's threads can abort a finalizing interpreter (see there)


if __name__ == "__main__":
    main()
