"""Worker for tests/test_pipeline_step.py (launched by torchrun, gloo): every rank trains the same
tiny model two ways, the one-process eager ``make_train_step`` and its pipeline rank's
``make_pipeline_train_step``, and checks that the losses agree at every step, that its final
params and Adam moments agree with the one-process ones under the same names, and that the
pipeline's forward-only evaluation (``make_pipeline_eval_step``) gives the one-process
``make_eval_step``'s loss before the first step and after the last.

``python -m tests.pipeline_worker SCHEDULE VIRTUAL MTP TIE FP16 [COMPILE [RECOMPUTE]]``: VIRTUAL 0 for
none; MTP, TIE, FP16, COMPILE (the stages and the update compiled) and RECOMPUTE (full recompute and
the output layer in chunks of 8 tokens) 0/1, the last two 0 by default.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.config.pipeline import check_microbatches, pipeline_split
from lmfunc.optim import adamw
from lmfunc.precision import LossScaleConfig
from lmfunc.train import TrainState, make_eval_step, make_train_step
from lmfunc.train.pipeline_step import make_pipeline_eval_step, make_pipeline_train_step, rank_params
from lmfunc.tree import flatten_with_paths, tree_unflatten_as
from tests.helpers import lm_batch

STEPS, MICROBATCHES = 5, 4
FP32_TOLERANCE = {"metrics": 1e-5, "leaves": 1e-5}
FP16_TOLERANCE = {"metrics": 5e-4, "leaves": 5e-3}
"""fp16 differs at the level of 16-bit rounding even on one stage, where nothing is split, and the
difference grows step by step: gradient norms 1e-5 to 2.3e-4 apart by the fifth step (the larger on
an Intel Xeon without AVX-512, tied or untied, with or without MTP), Adam moments of norm scales up
to 1.4e-3 (rel L2, measured). The evaluation losses agree exactly at the same params. The
schedule's ``autograd.backward`` into parameters and the one-process step's ``autograd.grad``
evidently order some 16-bit reductions differently; the cause is not pinned down."""

COMPILED_LEAVES_TOLERANCE = 2e-4
"""Compiled stages against the eager one-process step: Inductor's kernels round differently, and
Adam turns that into parameter differences of up to 9.6e-5 (rel L2) in five steps, the same leaf
and size as the one-process compiled step against the eager one (measured); the losses and
gradient norms still agree to 1e-5."""


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main() -> None:
    schedule, virtual, mtp, tie, fp16 = sys.argv[1], int(sys.argv[2]) or None, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    compiled = len(sys.argv) > 6 and bool(int(sys.argv[6]))
    recompute = len(sys.argv) > 7 and bool(int(sys.argv[7]))
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    split = pipeline_split(8, pp=pp, schedule=schedule, virtual_stages=virtual)
    check_microbatches(schedule, split, MICROBATCHES)
    extras = {"recompute_granularity": "full", "cross_entropy_chunk_tokens": 8} if recompute else {}
    cfg = dataclasses.replace(model_preset("tiny", num_layers=8, **extras), tie_embeddings=bool(tie), mtp_num_layers=mtp,
                              hidden_dropout=0.1)
    params = model.init(cfg, seed=0)
    tx = adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    scaling = LossScaleConfig(initial_scale=2.0**15) if fp16 else None
    dtype = torch.float16 if fp16 else torch.float32
    reference = make_train_step(cfg, tx, compile=False, compute_dtype=dtype, loss_scale=scaling)
    piped = make_pipeline_train_step(cfg, tx, split, schedule, MICROBATCHES, compute_dtype=dtype, loss_scale=scaling,
                                     compile=compiled)
    whole = TrainState.create(params, tx, loss_scale=scaling)
    mine = TrainState.create(rank_params(params, cfg, split, rank), tx, loss_scale=scaling)
    tolerance, worst = (FP16_TOLERANCE if fp16 else FP32_TOLERANCE), 0.0
    if compiled:
        tolerance = {**tolerance, "leaves": max(tolerance["leaves"], COMPILED_LEAVES_TOLERANCE)}
    evaluate = make_eval_step(cfg, compute_dtype=dtype, compile=False)
    piped_eval = make_pipeline_eval_step(cfg, split, schedule, MICROBATCHES, compute_dtype=dtype, compile=compiled)
    held_out = lm_batch(cfg.vocab_size, MICROBATCHES, 2, 16, seed=100)

    def eval_error() -> float:
        """The pipeline's eval loss against the one-process eval at the pipeline's own params."""
        parts = [None] * pp
        dist.all_gather_object(parts, dict(flatten_with_paths(mine.params)))
        gathered = {path: leaf for part in parts for path, leaf in part.items()}
        full = tree_unflatten_as(whole.params, [gathered[path] for path, _ in flatten_with_paths(whole.params)])
        expected, got = evaluate(full, held_out), piped_eval(mine.params, held_out)
        assert float(got["num_tokens"]) == float(expected["num_tokens"]), (got, expected)
        return abs(float(got["loss_sum"]) - float(expected["loss_sum"])) / abs(float(expected["loss_sum"]))

    worst = eval_error()
    for step in range(STEPS):
        batch = lm_batch(cfg.vocab_size, MICROBATCHES, 2, 16, seed=step)
        whole, expected = reference(whole, batch)
        mine, got = piped(mine, batch)
        for key, value in expected.items():
            worst = max(worst, abs(float(got[key]) - float(value)) / max(abs(float(value)), 1e-12))
    worst = max(worst, eval_error())
    assert worst < tolerance["metrics"], f"rank {rank}: metrics or eval losses differ by rel {worst:.2e}"
    reference_leaves = dict(flatten_with_paths((whole.params, whole.opt_state)))
    mine_leaves = flatten_with_paths((mine.params, mine.opt_state))
    errors = {path: rel_l2(leaf, reference_leaves[path]) for path, leaf in mine_leaves
              if leaf.is_floating_point() and leaf.dim() > 0}
    path, error = max(errors.items(), key=lambda item: item[1])
    assert error < tolerance["leaves"], f"rank {rank}: {path} differs by rel L2 {error:.2e}"
    print(f"rank {rank} ok: {len(errors)} leaves, worst metric rel {worst:.1e}, worst leaf {path} {error:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
