"""Probe (issue 57, the dry run's pipeline roles): one pipeline rank's eager train step, run on
fake tensors over a fake process group, as a dry run would trace it.

The trainer's own pipeline step (``lmfunc.train.pipeline_run.pipeline_steps``, eager) is built for
``rank`` of a world of ``--pp`` ranks (the fake backend, ``lmfunc.dryrun.world``) and called once
with its state and batch as fake tensors. Three things torch's pipeline schedule needs are given
here, each of which a dry run would have to give too:

1. The steps are built outside ``FakeTensorMode``: building them reads the mesh's ranks
   (``lmfunc.train.pipeline_groups``), which fake tensors refuse.
2. The schedule's P2P warm-up vote (``_warmup_p2p``, which reads a received tensor with
   ``.item()`` and which the fake backend never writes) is replaced by its result for stages
   whose shapes are given: every stage static.
3. Every stage is given its input and output shapes (``PipelineStage(input_args=, output_args=)``),
   so torch does not infer them by sending metadata between the ranks. The outputs require grad,
   else torch makes no buffer for the gradient a stage receives.

Prints, for each rank, the metrics the step returned (fake) and the seconds it took.

    python -m experiments.probes.pipeline_fake_step [--pp 2] [--schedule 1f1b] [--virtual-stages 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed import pipelining
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import InferenceMode

import lmfunc.train.pipeline_step as pipeline_step
from lmfunc.config.command_line import parse_config
from lmfunc.dryrun.capture import batch_plan, fake_batch
from lmfunc.dryrun.world import fake_world, mesh_of
from lmfunc.parallel.mesh import Layout
from lmfunc.precision import compute_dtype
from lmfunc.train.make_optimizer import run_optimizer
from lmfunc.train.pipeline_run import init_rank_params, pipeline_rank, pipeline_steps
from lmfunc.train.state import TrainState


def _static_vote(self, stages, has_backward, p2p_done) -> None:
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


class _StagesWithShapes:
    """``torch.distributed.pipelining`` as ``lmfunc.train.pipeline_step`` uses it, whose
    ``PipelineStage`` is given the stage's input and output shapes (the default model's: tokens
    ``[micro, S]`` into the first stage, hidden states ``[micro, S, H]`` between stages)."""

    def __init__(self, micro: int, seq: int, hidden: int):
        self.micro, self.seq, self.hidden = micro, seq, hidden

    def __getattr__(self, name):
        return getattr(pipelining, name)

    def PipelineStage(self, module, stage, num_stages, device, group=None):  # noqa: N802 (torch's name)
        hidden = torch.empty(self.micro, self.seq, self.hidden, device="meta", requires_grad=True)
        inputs = (torch.empty(self.micro, self.seq, dtype=torch.int64, device="meta"),) if stage == 0 else (hidden,)
        outputs = (hidden,) if stage < num_stages - 1 else (torch.empty((), device="meta", requires_grad=True),)
        return pipelining.PipelineStage(module, stage, num_stages, device, input_args=inputs, output_args=outputs,
                                        group=group)


def fake_pipeline_step(pp: int, schedule: str, rank: int, virtual_stages: int = 1) -> tuple[dict, float]:
    """The metrics of ``rank``'s eager pipeline train step on fake tensors, and its seconds."""
    cfg, _ = parse_config(["--parallel.pp", str(pp), "--parallel.pp-schedule", schedule, "--parallel.virtual-stages",
                           str(virtual_stages), "--run.global-batch-size", str(8 * 2 * pp), "--run.no-compile"],
                          "probe", "probe")
    cfg = cfg.validate(pp)
    sizes, plan = cfg.parallel.sizes(pp), batch_plan(cfg, pp)
    microbatches = plan.num_microbatches_at(0)
    schedules._PipelineSchedule._warmup_p2p = _static_vote
    pipeline_step.pipelining = _StagesWithShapes(cfg.run.micro_batch_size, cfg.data.seq_length, cfg.model.hidden_size)
    began = time.perf_counter()
    with fake_world(pp, rank):
        layout = Layout(dict(sizes), mesh_of(sizes))
        pipe = pipeline_rank(cfg, layout)
        meta_params = init_rank_params(cfg.model, pipe, cfg.run.seed, torch.device("meta"))
        tx, lr_schedule = run_optimizer(cfg, plan, cfg.run.train_iters, meta_params)
        loss_scale = cfg.precision.loss_scaling()
        train_step, _, _ = pipeline_steps(cfg, pipe, microbatches, tx, lr_schedule, loss_scale,
                                          compute_dtype(cfg.precision.compute_dtype), torch.device("cpu"))
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = init_rank_params(cfg.model, pipe, cfg.run.seed, torch.device("cpu"))
            state = TrainState.create(params, tx, seed=cfg.run.seed, loss_scale=loss_scale)
            _, metrics = train_step(state, fake_batch(cfg, microbatches, Layout(dict(sizes), None)))
    return {k: (type(v).__name__, tuple(v.shape)) for k, v in metrics.items()}, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=1)
    args = parser.parse_args()
    for rank in range(args.pp):
        metrics, seconds = fake_pipeline_step(args.pp, args.schedule, rank, args.virtual_stages)
        print(f"rank {rank}: {seconds:.2f} s, metrics {metrics}")


if __name__ == "__main__":
    main()
