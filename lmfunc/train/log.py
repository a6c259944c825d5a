"""Where a run's numbers go: the terminal (a tqdm bar and log lines), ``log.jsonl`` and TensorBoard."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

from tqdm import tqdm

from lmfunc.config.model import ConfigError


def _tensorboard_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "log.tensorboard needs the tensorboard package: pip install tensorboard "
            "(or pip install -e '.[tensorboard]'), or drop --log.tensorboard"
        ) from None
    return SummaryWriter


class RunLogger:
    """Writes records to ``RUN_DIR/log.jsonl`` (one JSON object per line with ``kind`` and ``step``),
    mirrors numeric fields to TensorBoard as ``<kind>/<field>``, and owns the terminal output.

    The files are opened at the first record, so a run refused during setup writes nothing."""

    def __init__(self, run_dir: Optional[str], total_steps: int, progress_bar: bool = True, tensorboard: bool = False):
        """``run_dir`` None makes a silent logger (the other ranks of a multi-process run)."""
        self.enabled = run_dir is not None
        self.path = os.path.join(run_dir, "log.jsonl") if run_dir is not None else ""
        self._bar: Optional[tqdm] = None
        self._tb, self._file = None, None
        if not self.enabled:
            return
        self._tb_dir = os.path.join(run_dir, "tensorboard")
        self._tb_class = _tensorboard_writer_class() if tensorboard else None
        if progress_bar:
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr)

    def echo(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def progress(self, step: int, **values: Any) -> None:
        """Advance the bar to ``step`` and show ``values`` beside it."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(values, refresh=False)

    def end_progress(self) -> None:
        """Close the progress bar; later lines print plainly."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def record(self, kind: str, step: int, **values: Any) -> None:
        """Append one JSONL record (and TensorBoard scalars for its numbers)."""
        if not self.enabled:
            return
        entry = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        if self._file is None:
            self._file = open(self.path, "a")
            self._tb = self._tb_class(self._tb_dir) if self._tb_class is not None else None
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.end_progress()
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


def read_log(path: str) -> list[dict]:
    """The records of a ``log.jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
