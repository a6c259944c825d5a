"""The train and evaluation steps of a run without a pipeline, built from its ``TrainConfig``: the
one place that chooses their arguments, shared by the trainer (``lmfunc.train.loop``) and the dry
run (``lmfunc.dryrun``), so that a dry run traces the very step the trainer runs."""

from __future__ import annotations

from typing import Callable, Union

from lmfunc.config.train import TrainConfig
from lmfunc.optim import GradientTransformation
from lmfunc.optim.transforms import Schedule
from lmfunc.precision import compute_dtype
from lmfunc.train.step import make_eval_step, make_train_step


def _bucket_size_mb(cfg: TrainConfig):
    return cfg.parallel.bucket_size_mb if cfg.parallel.bucket_collectives else None


def run_train_step(cfg: TrainConfig, tx: GradientTransformation, schedule: Schedule, on_mesh: bool,
                   backend: Union[str, Callable] = "inductor", compile: bool | None = None) -> Callable:
    """The run's ``step(state, batch) -> (state, metrics)``: donating its state, compiled unless
    ``run.compile`` is off (``compile`` overrides it), precompiled (``run.precompile``) on a single
    process with Inductor, its data-parallel collectives bucketed by ``parallel``'s settings."""
    compile = cfg.run.compile if compile is None else compile
    return make_train_step(
        cfg.model, tx, clip_grad=cfg.optim.clip_grad, lr_schedule=schedule,
        compute_dtype=compute_dtype(cfg.precision.compute_dtype), loss_scale=cfg.precision.loss_scaling(),
        calculate_per_token_loss=cfg.run.calculate_per_token_loss, compile=compile, backend=backend,
        donate_state=True, precompile=cfg.run.precompile and not on_mesh, bucket_size_mb=_bucket_size_mb(cfg),
    )


def run_eval_step(cfg: TrainConfig, on_mesh: bool) -> Callable:
    """The run's ``eval_step(params, batch)``, compiled and precompiled as the train step."""
    return make_eval_step(cfg.model, compute_dtype=compute_dtype(cfg.precision.compute_dtype), compile=cfg.run.compile,
                          precompile=cfg.run.precompile and not on_mesh, bucket_size_mb=_bucket_size_mb(cfg))
