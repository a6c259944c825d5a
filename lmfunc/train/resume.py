"""A run's checkpoints: where they live, what a resume loads, and the model-shape check.

The whole ``TrainState`` is one checkpoint (params, optimizer state with its step count, loss
scaler, step, consumed samples, the dropout seed) plus the resolved config as ``config.yaml``.
The data order follows from ``consumed_samples`` and every random draw of the step from
``(state.rng, state.step)``, so restoring the state restores the run exactly.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from lmfunc.checkpoint.locate import saved_config
from lmfunc.checkpoint.manager import complete_steps, latest_step, step_dir_name
from lmfunc.checkpoint.sharded import load_tree
from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.config.train import RunConfig, TrainConfig
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
    """Where a run writes (``run_dir``, ``save_dir``), where it loads from, and the step it loads
    (None: a fresh start)."""

    run_dir: str
    save_dir: str
    load_dir: str
    load_step: Optional[int]


def prepare_run_paths(cfg: TrainConfig) -> RunPaths:
    """Decide the run's directories and the checkpoint it starts from (call on one rank, then
    ``broadcast``) and create the run directory. A named run directory that already holds a run is
    an error unless the run resumes from a checkpoint in its own save_dir."""
    run_dir = _run_dir_path(cfg.run)
    save_dir = cfg.checkpoint.save_dir or os.path.join(run_dir, "checkpoints")
    load_dir = cfg.checkpoint.load or save_dir
    # With load_hf the run starts from imported weights, unless it already has checkpoints of its own
    # (a restart of that run resumes from them).
    step = step_to_load(cfg, load_dir)
    resuming_here = step is not None and cfg.checkpoint.load is None
    if os.path.exists(os.path.join(run_dir, "log.jsonl")) and not resuming_here:
        raise ConfigError(
            f"run directory {run_dir} already holds a run and {save_dir} has no checkpoint to resume from"
            + ("" if cfg.checkpoint.resume else " (resuming is off: --checkpoint.no-resume)")
            + "; pick another run.name or remove the directory"
        )
    os.makedirs(run_dir, exist_ok=True)
    return RunPaths(run_dir, save_dir, load_dir, step)


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
        raise ConfigError(f"checkpoint.load {load_dir} holds no complete checkpoint (iter_NNNNNNN/ with metadata.json)")
    return step


def broadcast(value: object) -> object:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Restored:
    """The state a run starts from and where it came from (None: freshly initialised)."""

    state: TrainState
    source: Optional[str]
    finetune: bool = False


def restore_state(cfg: TrainConfig, fresh: TrainState, load_dir: str, step: Optional[int]) -> Restored:
    """``fresh`` (a newly initialised state in this run's layout) or, when ``step`` is given, the
    checkpoint of that step loaded into ``fresh``'s layout: the whole state, or only the params with
    ``checkpoint.finetune``. The saved model must have the same shapes (checked first)."""
    if step is None:
        return Restored(fresh, None)
    path = os.path.join(load_dir, step_dir_name(step))
    check_model_matches(saved_config(path).model, cfg.model, path)
    if cfg.checkpoint.finetune:
        loaded = load_tree({"params": fresh.params}, path, allow_unused=True)
        return Restored(fresh.replace(params=loaded["params"]), path, finetune=True)
    try:
        return Restored(load_tree(fresh, path), path)
    except ValueError as err:
        raise ConfigError(f"{err}. The run's optimizer or precision settings differ from the checkpoint's "
                          "(e.g. loss scaling on/off); match them or use --checkpoint.finetune") from None
