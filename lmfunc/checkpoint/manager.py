"""Checkpoint directories with Megatron's layout and orbax's guarantees.

::

    save_dir/latest_checkpointed_iteration.txt    "<step>", rewritten (atomically) after each save
    save_dir/iter_0000100/                        one complete checkpoint
        .metadata, __<rank>_0.distcp              the DCP files (``lmfunc.checkpoint.sharded``)
        config.yaml ...                           files handed to ``save`` (the run's config)
        metadata.json                             the completion marker, written last

A save writes into ``iter_0000100.tmp/``, adds the marker once every rank's shards are written,
renames the directory to ``iter_0000100`` and only then updates the tracker, so a crash at any
moment leaves the previous checkpoint as the newest complete one. Directories without the marker
are never loaded and are removed when a manager opens ``save_dir``. Saves may run in the background
(one at a time); the newest ``keep`` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import Future
from typing import Callable, Optional

import torch.distributed as dist

from lmfunc.checkpoint.sharded import async_save_tree, load_tree, save_tree
from lmfunc.tree import PyTree

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "metadata.json"
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")


def step_dir_name(step: int) -> str:
    """``iter_0000100`` for step 100 (Megatron's ``iter_{:07d}``)."""
    return f"iter_{step:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints (``iter_*`` with the marker) in ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(directory, name, MARKER)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(directory: str) -> Optional[int]:
    """The step named by the tracker file when that checkpoint is complete, else the newest
    complete one; None when ``directory`` holds no complete checkpoint."""
    steps = complete_steps(directory)
    try:
        with open(os.path.join(directory, TRACKER)) as f:
            tracked = int(f.read().strip())
        if tracked in steps:
            return tracked
    except (FileNotFoundError, ValueError):
        pass
    return steps[-1] if steps else None


def remove_partial(directory: str) -> list[str]:
    """Delete the unfinished saves in ``directory`` (``*.tmp`` directories and ``iter_*`` without
    the marker); return their names."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        unfinished = name.startswith("iter_") and name.endswith(".tmp")
        unmarked = _STEP_DIR.match(name) is not None and not os.path.isfile(os.path.join(path, MARKER))
        if os.path.isdir(path) and (unfinished or unmarked):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


class CheckpointManager:
    """Saves and restores pytrees under ``directory`` (the same path on every rank).

    keep: the newest complete checkpoints kept (None keeps all).
    async_save: ``save`` returns once the write has started; the write finishes in the background
        (one in flight: the next ``save`` or ``wait`` waits for it).
    process_group: the group of the checkpoint collectives; with several ranks the manager makes
        its own gloo group, so background writes never share a group with training.
    Every rank must call ``save``, ``wait`` and ``restore`` in the same order (they are collectives).
    """

    def __init__(self, directory: str, keep: Optional[int] = None, async_save: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep every checkpoint), got {keep}")
        self.directory, self.keep, self.async_save = directory, keep, async_save
        distributed = dist.is_available() and dist.is_initialized()
        self.process_group = process_group if process_group is not None or not distributed else dist.new_group(backend="gloo")
        self.removed_partial: list[str] = []
        if _rank() == 0:
            os.makedirs(directory, exist_ok=True)
            self.removed_partial = remove_partial(directory)
        self._pending: Optional[tuple[int, Future, Callable[[], None]]] = None
        self.last_saved: Optional[int] = None

    def path(self, step: int) -> str:
        return os.path.join(self.directory, step_dir_name(step))

    def steps(self) -> list[int]:
        return complete_steps(self.directory)

    def latest(self) -> Optional[int]:
        return latest_step(self.directory)

    def save(self, step: int, tree: PyTree, files: Optional[dict[str, str]] = None, stage: bool = False) -> None:
        """Checkpoint ``tree`` as step ``step``, with ``files`` (name -> text) written beside the
        shards by rank 0. With async_save the tensors of ``tree`` must stay unmodified until the
        save completes, unless ``stage`` copies them first (needed when the next train step
        donates its state: ``make_train_step(donate_state=True)``)."""
        self.wait()
        tmp = self.path(step) + ".tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            for name, text in (files or {}).items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.process_group)

        def finish() -> None:
            if _rank() == 0:
                self._commit(step, tmp)
            self.last_saved = step

        if self.async_save:
            self._pending = (step, async_save_tree(tree, tmp, self.process_group, stage=stage), finish)
        else:
            save_tree(tree, tmp, self.process_group)
            finish()

    def _commit(self, step: int, tmp: str) -> None:
        """Marker, rename, tracker, then pruning: each later step only happens after the earlier."""
        marker = {"sharded_backend": "torch_dcp", "sharded_backend_version": 1, "iteration": step}
        _write_atomically(os.path.join(tmp, MARKER), json.dumps(marker) + "\n")
        final = self.path(step)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomically(os.path.join(self.directory, TRACKER), f"{step}\n")
        if self.keep is not None:
            for old in self.steps()[:-self.keep]:
                if old != step:
                    shutil.rmtree(self.path(old), ignore_errors=True)

    def in_flight(self) -> Optional[int]:
        """The step of the background save still being written, if any (finishing a done one)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()
        return self._pending[0] if self._pending is not None else None

    def wait(self) -> None:
        """Block until the background save (if any) is written and committed; re-raise its error."""
        if self._pending is None:
            return
        step, future, finish = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as err:
            raise RuntimeError(f"saving checkpoint step {step} to {self.path(step)}.tmp failed: {err}") from err
        finish()

    def restore(self, like: PyTree, step: int, allow_unused: bool = False) -> PyTree:
        """The checkpoint of ``step`` loaded into the layout of ``like`` (see ``load_tree``)."""
        path = self.path(step)
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER}); complete steps in "
                                    f"{self.directory}: {self.steps() or 'none'}")
        return load_tree(like, path, self.process_group, allow_unused)

    def close(self) -> None:
        """Wait for the background save; the manager can still be used afterwards."""
        self.wait()
