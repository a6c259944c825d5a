"""What a run does with its checkpoints: saves at the interval and at the end, a line and a record
for each commit, a failed save reported with the run's policy (``checkpoint.on_save_error``), and
the final weights, written to a temporary folder when the run folder cannot take them."""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Optional

from lmfunc.checkpoint import save_weights
from lmfunc.checkpoint.locate import CONFIG_FILE
from lmfunc.checkpoint.manager import CheckpointManager, SaveFailed
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import config_yaml
from lmfunc.train.log import RunLogger
from lmfunc.train.state import TrainState


class RunCheckpoints:
    """The checkpoint side of one run (``manager`` is None when ``checkpoint.save`` is off)."""

    def __init__(self, cfg: TrainConfig, save_dir: str, logger: RunLogger) -> None:
        self.cfg, self.logger = cfg, logger
        ck = cfg.checkpoint
        self.manager = CheckpointManager(save_dir, ck.keep, ck.async_save) if ck.save else None
        if self.manager is not None and self.manager.removed_partial:
            logger.echo(f"removed unfinished checkpoint saves in {save_dir}: {', '.join(self.manager.removed_partial)}")
        self.committed = self.manager.last_saved if self.manager is not None else None
        self.saved_step: Optional[int] = None
        self.error: Optional[SaveFailed] = None
        """The last failed save, until a later save commits."""

    def note_damaged(self, load_dir: str, steps: tuple[int, ...]) -> None:
        """The resume skipped the checkpoints of ``steps`` in ``load_dir`` as damaged: when that is
        the save folder, they do not count toward ``checkpoint.keep`` (so no good checkpoint is
        pruned in their favour)."""
        if self.manager is not None and steps and os.path.realpath(load_dir) == os.path.realpath(self.manager.directory):
            self.manager.damaged.update(steps)

    @property
    def stop_requested(self) -> bool:
        """A save failed and ``checkpoint.on_save_error`` is ``stop``."""
        return self.error is not None and self.cfg.checkpoint.on_save_error == "stop"

    def after_step(self, step: int, state: TrainState) -> None:
        """Note finished background saves and save at the interval."""
        if self.manager is None:
            return
        interval = self.cfg.checkpoint.save_interval
        try:
            self.manager.in_flight()
            self.note_commits()
            if interval is not None and step % interval == 0:
                self.save(step, state)
        except SaveFailed as err:
            self._failed(err, step)

    def save(self, step: int, state: TrainState) -> None:
        """Save ``state`` as ``step`` (staged: the next train step donates the state's tensors)."""
        self.manager.save(step, state, files={CONFIG_FILE: config_yaml(self.cfg)}, stage=True)
        self.saved_step = step
        self.note_commits()

    def finish(self, step: int, state: TrainState, save: bool = True) -> None:
        """The last save (unless ``save`` is False: every rank stopped for a failed one) and the
        wait for it."""
        if self.manager is None:
            return
        try:
            if self.saved_step != step and save:
                self.save(step, state)
            self.manager.wait()
            self.note_commits()
        except SaveFailed as err:
            self._failed(err, step)

    def note_commits(self) -> None:
        """Log the background saves that have been committed since the last call."""
        if self.manager is not None and self.manager.last_saved != self.committed:
            self.committed = self.manager.last_saved
            self.error = None
            self.logger.record("checkpoint", self.committed, path=self.manager.path(self.committed))
            self.logger.echo(f"saved checkpoint {self.manager.path(self.committed)}")

    def _failed(self, err: SaveFailed, step: int) -> None:
        self.error = err
        self.logger.record("checkpoint_failed", step, error=str(err))
        then = ("training goes on (checkpoint.on_save_error continue); the next save is tried at its interval"
                if self.cfg.checkpoint.on_save_error == "continue" else "the run stops")
        self.logger.echo(f"error: {err}. {then}")

    def write_weights(self, params, run_dir: str, step: int, echo: Callable[[str], None]) -> str:
        """``run_dir/model.safetensors``, or a new temporary folder's when that cannot be written
        (said through ``echo``); returns the path written."""
        path = os.path.join(run_dir, "model.safetensors")
        try:
            save_weights(params, path, {"step": str(step)})
            return path
        except Exception as err:  # an OSError, or safetensors' own I/O error
            reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
            fallback = os.path.join(tempfile.mkdtemp(prefix="lmfunc-weights-"), "model.safetensors")
            echo(f"error: cannot write {path} ({reason}); writing the final weights to {fallback}")
        save_weights(params, fallback, {"step": str(step)})
        echo(f"final weights (step {step}) written to {fallback}")
        return fallback

    def close(self) -> None:
        """Finish a save still being written (an error may be on its way out), reporting its failure."""
        if self.manager is not None and self.manager.in_flight() is not None:
            try:
                self.manager.wait()
            except SaveFailed as err:
                self.logger.echo(f"error: {err}")
