"""The train and evaluation steps of a run without a pipeline, built from its ``TrainConfig``: the
one place that chooses their arguments, shared by the trainer (``lmfunc.train.loop``) and the dry
run (``lmfunc.dryrun``), so that a dry run traces the very step the trainer runs."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Union

import torch

from lmfunc.compiler.torch_compat.inductor import inductor_config
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


def expert_rows_per_peer(cfg: TrainConfig, sizes: dict[str, int]) -> Optional[int]:
    """Under an even share of the experts' tokens, the rows an expert-parallel rank sends to each
    rank of its ``ep`` group and receives from each: its own tokens (the micro batch's, split over
    ``cp`` and, with sequence parallelism, ``tp``) times the router's top-k, over ``ep``. None
    without expert parallelism."""
    m, ep = cfg.model, sizes.get("ep", 1)
    if ep == 1 or not m.num_experts:
        return None
    tokens = cfg.run.micro_batch_size * cfg.data.seq_length // sizes["cp"]
    tokens //= sizes["tp"] if m.sequence_parallel else 1
    return max(1, tokens * m.moe_router_topk // ep)


@contextlib.contextmanager
def even_expert_share(cfg: TrainConfig, sizes: dict[str, int], load: float = 1.0) -> Iterator[None]:
    """While inside, a size known only at run time (the rows each expert-parallel rank exchanges,
    read back from the routed counts) is taken at ``expert_rows_per_peer`` wherever a number is
    needed: Inductor's buffer sizes and schedule and the saved-value choice when the run compiles,
    and in a dry run also the FLOPs, the buffers and the bytes a pipeline rank keeps. It is
    Inductor's ``unbacked_symint_fallback`` (8192 by default), the value each unknown takes in
    torch's estimates; the trainer runs inside it, so a dry run compiles the very graphs it does.
    ``load`` scales the rows (1.0, the trainer's: an even share; 1.5: a rank that gets half as many
    again, such as the busiest rank of a router out of balance)."""
    rows = expert_rows_per_peer(cfg, sizes)
    if rows is None:
        yield
        return
    if not load > 0:
        raise ValueError(f"even_expert_share(load={load}): the rows' multiple of an even share must be positive")
    with inductor_config.patch(unbacked_symint_fallback=max(1, round(rows * load))):
        yield
