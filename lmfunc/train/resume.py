"""A run's checkpoints: where they live, what a resume loads, and the model-shape check.

The whole ``TrainState`` is one checkpoint (params, optimizer state with its step count, loss
scaler, step, consumed samples, the dropout seed) plus the resolved config as ``config.yaml``.
The data order follows from ``consumed_samples`` and every random draw of the step from
``(state.rng, state.step)``, so restoring the state restores the run exactly.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch.distributed as dist

from lmfunc.checkpoint.locate import saved_config
from lmfunc.checkpoint.manager import check_save_dir, complete_steps, foreign_entries, latest_step, step_dir_name
from lmfunc.checkpoint.sharded import DamagedCheckpoint, load_tree
from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.config.train import RunConfig, TrainConfig
from lmfunc.train.make_optimizer import schedule_settings
from lmfunc.train.run_lock import RunLock, acquire
from lmfunc.train.state import TrainState

def _shape_fields(cfg: ModelConfig) -> dict[str, object]:
    """The model settings that decide parameter names and shapes (defaults resolved), as
    Megatron's ``check_checkpoint_args`` compares them."""
    fields = {
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_query_groups": cfg.query_groups,
        "kv_channels": cfg.head_dim, "ffn_hidden_size": cfg.ffn_size, "vocab_size": cfg.vocab_size,
        "position_embedding_type": cfg.position_embedding_type, "normalization": cfg.normalization,
        "activation": cfg.activation, "qk_layernorm": cfg.qk_layernorm, "add_bias_linear": cfg.add_bias_linear,
        "tie_embeddings": cfg.tie_embeddings, "mtp_num_layers": cfg.mtp_num_layers,
        "scan_layers": cfg.scan_layers,
    }
    if cfg.position_embedding_type == "learned_absolute":
        fields["max_position_embeddings"] = cfg.max_position_embeddings
    return fields


def check_model_matches(saved: ModelConfig, current: ModelConfig, source: str) -> None:
    """Raise ``ConfigError`` naming every shape-deciding model field that differs, with both values."""
    before, now = _shape_fields(saved), _shape_fields(current)
    differing = [f"model.{k}: checkpoint {before.get(k)!r}, this run {now.get(k)!r}"
                 for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if differing:
        raise ConfigError(
            f"checkpoint {source} was saved with a different model: " + "; ".join(differing)
            + ". Use the checkpoint's model settings, or start without it (--checkpoint.no-resume, or another "
            "--checkpoint.load / run.name)"
        )


def _run_dir_path(run: RunConfig) -> str:
    """``out_dir/name``, or a new ``out_dir/<timestamp>[-n]`` when ``name`` is None."""
    if run.name is not None:
        return os.path.join(run.out_dir, run.name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(run.out_dir, stamp), 1
    while os.path.exists(path):
        path, n = os.path.join(run.out_dir, f"{stamp}-{n}"), n + 1
    return path


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes (``run_dir``, ``save_dir``), where it loads from, the step it loads
    (None: a fresh start) and the config it runs with (the checkpoint's schedule taken over with
    ``optim.use_checkpoint_opt_param_scheduler``)."""

    run_dir: str
    save_dir: str
    load_dir: str
    load_step: Optional[int]
    cfg: TrainConfig


def check_writable(path: str, what: str) -> None:
    """Raise ``ConfigError`` unless directory ``path`` exists or can be created, and can be written
    (tried with a temporary file in it or in its nearest existing parent)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{what} {path}: {existing} is a file, not a directory; pick another path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be written ({existing}: {err.strerror}); pick a writable path") from None


def _checked_resume_config(cfg: TrainConfig, step_dir: str) -> TrainConfig:
    """``cfg`` after comparing it with the checkpoint it resumes: the model must match; the
    learning-rate and weight-decay schedule must match unless ``optim.override_opt_param_scheduler``
    (keep this run's) or ``optim.use_checkpoint_opt_param_scheduler`` (take the checkpoint's) is set,
    as Megatron's ``OptimizerParamScheduler.load_state_dict`` rules."""
    saved = saved_config(step_dir)
    check_model_matches(saved.model, cfg.model, step_dir)
    if cfg.checkpoint.finetune or cfg.optim.override_opt_param_scheduler:
        return cfg
    before, now = schedule_settings(saved), schedule_settings(cfg)
    if before == now:
        return cfg
    if cfg.optim.use_checkpoint_opt_param_scheduler:
        if set(before) != set(now):
            raise ConfigError(f"checkpoint {step_dir} schedules by {'iterations' if saved.run.train_iters else 'samples'}"
                              " and this run does not: its schedule cannot be taken over; use "
                              "--optim.override-opt-param-scheduler or the same run.train_iters/train_samples kind")
        return replace(cfg, optim=replace(cfg.optim, lr_warmup_fraction=None, **before))
    differing = [f"{k}: checkpoint {before.get(k)!r}, this run {now.get(k)!r}"
                 for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    raise ConfigError(
        f"checkpoint {step_dir} was trained with another learning-rate schedule: " + "; ".join(differing)
        + ". Resuming would change the lr mid-run: keep the checkpoint's settings, or pass "
        "--optim.use-checkpoint-opt-param-scheduler (continue the checkpoint's schedule) or "
        "--optim.override-opt-param-scheduler (switch to this run's)"
    )


def prepare_run_paths(cfg: TrainConfig) -> tuple[RunPaths, list[RunLock]]:
    """Decide the run's directories, the checkpoint it starts from and the config it runs with
    (call on one rank, then ``broadcast`` the paths), after every check that can refuse the run and
    before anything is written. The run directory is created and locked (and save_dir, when it is
    elsewhere); the caller releases the locks. A named run directory that already holds a run is an
    error unless the run resumes from a checkpoint in its own save_dir. A save_dir holding
    checkpoints lmfunc did not write is refused."""
    run_dir = _run_dir_path(cfg.run)
    save_dir = cfg.checkpoint.save_dir or os.path.join(run_dir, "checkpoints")
    load_dir = cfg.checkpoint.load or save_dir
    check_writable(cfg.run.out_dir, "run.out_dir")
    check_writable(run_dir, "run directory")
    if cfg.checkpoint.save:
        check_writable(save_dir, "checkpoint.save_dir")
        check_save_dir(save_dir)
    created = not os.path.exists(run_dir)
    locks = [acquire(run_dir)]
    try:
        outside = os.path.relpath(os.path.abspath(save_dir), os.path.abspath(run_dir)).startswith("..")
        if cfg.checkpoint.save and outside:
            locks.append(acquire(save_dir, "checkpoint.save_dir"))
        # With load_hf the run starts from imported weights, unless it already has checkpoints of its
        # own (a restart of that run resumes from them).
        step = step_to_load(cfg, load_dir)
        resuming_here = step is not None and cfg.checkpoint.load is None
        if os.path.exists(os.path.join(run_dir, "log.jsonl")) and not resuming_here:
            raise ConfigError(
                f"run directory {run_dir} already holds a run and {save_dir} has no checkpoint to resume from"
                + ("" if cfg.checkpoint.resume else " (resuming is off: --checkpoint.no-resume)")
                + "; pick another run.name or remove the directory"
            )
        if step is not None:
            cfg = _checked_resume_config(cfg, os.path.join(load_dir, step_dir_name(step)))
    except BaseException:
        for lock in locks:
            lock.release()
        if created and os.path.isdir(run_dir) and not os.listdir(run_dir):
            os.rmdir(run_dir)
        raise
    return RunPaths(run_dir, save_dir, load_dir, step, cfg), locks


def step_to_load(cfg: TrainConfig, load_dir: str) -> Optional[int]:
    """The checkpoint step a run starts from, or None for a fresh start. An explicit
    ``checkpoint.load`` or ``load_step`` that finds nothing is an error; the automatic resume
    from save_dir simply starts fresh."""
    ck = cfg.checkpoint
    explicit = ck.load is not None or ck.load_step is not None
    if not ck.resume and not explicit:
        return None
    steps = complete_steps(load_dir)
    if ck.load_step is not None:
        if ck.load_step not in steps:
            raise ConfigError(f"checkpoint.load_step {ck.load_step}: {load_dir} has no complete checkpoint of that step; "
                              f"complete steps: {steps or 'none'}")
        return ck.load_step
    step = latest_step(load_dir)
    if step is None and ck.load is not None:
        found = foreign_entries(load_dir)
        megatron = any("Megatron" in entry for entry in found)
        raise ConfigError(f"checkpoint.load {load_dir} holds no complete lmfunc checkpoint (iter_NNNNNNN/ with metadata.json)"
                          + (f"; found {'; '.join(found)}" if found else "")
                          + (f". To start from a Megatron checkpoint's weights, pass --checkpoint.load-megatron {load_dir} "
                             "instead of --checkpoint.load" if megatron else ""))
    return step


def broadcast(value: object) -> object:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def prepare_run_paths_on_every_rank(cfg: TrainConfig, main_rank: bool) -> tuple[RunPaths, list[RunLock]]:
    """Rank 0's ``prepare_run_paths`` on every rank (its ConfigError raised on every rank); the
    locks it took (rank 0 only)."""
    decision: object = None
    locks: list[RunLock] = []
    if main_rank:
        try:
            decision, locks = prepare_run_paths(cfg)
        except ConfigError as err:
            decision = err
    decision = broadcast(decision)
    if isinstance(decision, ConfigError):
        raise decision
    return decision, locks


@dataclass
class Restored:
    """The state a run starts from and where it came from (None: freshly initialised)."""

    state: TrainState
    source: Optional[str]
    finetune: bool = False
    damaged: tuple[int, ...] = ()
    """Steps of the newer checkpoints in the load folder that were skipped as damaged."""


def restore_state(cfg: TrainConfig, fresh: TrainState, load_dir: str, step: Optional[int],
                  warn: Callable[[str], None] = print, part: bool = False) -> Restored:
    """``fresh`` (a newly initialised state in this run's layout) or, when ``step`` is given, the
    checkpoint of that step loaded into ``fresh``'s layout: the whole state, or only the params with
    ``checkpoint.finetune``. The saved model must have the same shapes (checked first).

    A damaged checkpoint (missing or unreadable files) found by the automatic resume is reported
    through ``warn`` and the previous complete one is tried (why ``checkpoint.keep`` defaults to 2),
    its step listed in ``Restored.damaged``;
    an explicit ``checkpoint.load_step`` is not replaced. When none loads: ``ConfigError``.
    ``part``: ``fresh`` holds a part of the model (a pipeline rank's leaves), so the checkpoint's
    other leaves are left unread.
    """
    if step is None:
        return Restored(fresh, None)
    candidates = [step] if cfg.checkpoint.load_step is not None else [s for s in reversed(complete_steps(load_dir)) if s <= step]
    damage, damaged_steps = [], []
    for candidate in candidates:
        path = os.path.join(load_dir, step_dir_name(candidate))
        try:
            return replace(_load_checkpoint(cfg, fresh, path, part), damaged=tuple(damaged_steps))
        except DamagedCheckpoint as err:
            damage.append(str(err))
            damaged_steps.append(candidate)
            if candidate != candidates[-1]:
                warn(f"warning: checkpoint {path} is damaged ({err}); loading the previous complete checkpoint "
                     "instead (the damaged one is left in place and not counted toward checkpoint.keep)")
    raise ConfigError(f"no checkpoint in {load_dir} can be loaded: " + "; ".join(damage)
                      + f". Complete steps: {complete_steps(load_dir)}; load another with --checkpoint.load-step, "
                      "or start fresh with --checkpoint.no-resume (or another run.name)")


def _load_checkpoint(cfg: TrainConfig, fresh: TrainState, path: str, part: bool) -> Restored:
    check_model_matches(saved_config(path).model, cfg.model, path)
    if cfg.checkpoint.finetune:
        loaded = load_tree({"params": fresh.params}, path, allow_unused=True)
        return Restored(fresh.replace(params=loaded["params"]), path, finetune=True)
    try:
        return Restored(load_tree(fresh, path, allow_unused=part), path)
    except ValueError as err:
        raise ConfigError(f"{err}. The run's optimizer or precision settings differ from the checkpoint's "
                          "(e.g. loss scaling on/off); match them or use --checkpoint.finetune") from None
