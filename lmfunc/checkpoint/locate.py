"""Finding a checkpoint from what a user points at (a run, a save_dir or one step) and its config."""

from __future__ import annotations

import os
from typing import Optional

from lmfunc.checkpoint.manager import MARKER, complete_steps, foreign_entries, is_lmfunc_checkpoint, latest_step, step_dir_name
from lmfunc.config.model import ConfigError
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import load_config

CONFIG_FILE = "config.yaml"


def find_step_dir(path: str, step: Optional[int] = None) -> str:
    """The complete checkpoint ``path`` names: a step directory (``iter_0000100``), a save_dir
    (its newest complete step, or ``step``) or a run directory (its ``checkpoints/``)."""
    if is_lmfunc_checkpoint(path) and step is None:
        return path
    save_dir = path
    if not complete_steps(save_dir) and os.path.isdir(os.path.join(path, "checkpoints")):
        save_dir = os.path.join(path, "checkpoints")
    steps = complete_steps(save_dir)
    if not steps:
        found = foreign_entries(save_dir)
        raise ConfigError(f"{path} holds no complete lmfunc checkpoint (a run directory, a save_dir with iter_NNNNNNN/ "
                          f"subdirectories, or one iter_NNNNNNN/ with {MARKER})"
                          + (f"; found {'; '.join(found)}" if found else ""))
    if step is not None and step not in steps:
        raise ConfigError(f"{save_dir} has no complete checkpoint of step {step}; complete steps: {steps}")
    return os.path.join(save_dir, step_dir_name(step if step is not None else latest_step(save_dir)))


def saved_config(step_dir: str) -> TrainConfig:
    """The resolved config stored in a checkpoint directory."""
    path = os.path.join(step_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint {step_dir} has no {CONFIG_FILE}; it was not written by lmfunc's training loop")
    return load_config(path)
