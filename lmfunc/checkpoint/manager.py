"""Checkpoint directories with Megatron's layout and orbax's guarantees.

::

    save_dir/latest_checkpointed_iteration.txt    "<step>", rewritten (atomically) after each save
    save_dir/iter_0000100/                        one complete checkpoint
        .metadata, __<rank>_0.distcp              the DCP files (``lmfunc.checkpoint.sharded``)
        config.yaml ...                           files handed to ``save`` (the run's config)
        metadata.json                             the completion marker, written last

A save writes into ``iter_0000100.tmp/`` (made and marked with the in-progress marker
``.lmfunc-in-progress`` under a hidden name, then renamed), adds the completion marker once every
rank's shards are written, renames the directory to ``iter_0000100`` and only then updates the
tracker, so a crash at any moment leaves the previous checkpoint as the newest complete one. Saves may run in the background (one at
a time); the newest ``keep`` complete checkpoints are kept.

lmfunc deletes only what it wrote: unfinished saves carrying the in-progress marker (when a
manager opens ``save_dir``) and its own complete checkpoints beyond ``keep``. A directory it deletes
is first renamed to a hidden name (``.lmfunc-removing-*``), so a kill during the deletion never
leaves a half-deleted ``iter_*`` entry without its marker; what such a kill leaves is removed when
a manager next opens ``save_dir``. Any other
``iter_*`` entry (a Megatron checkpoint, a copy without the marker) is never loaded, pruned or
removed: ``check_save_dir`` refuses such a save_dir, naming what it found.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from concurrent.futures import Future
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lmfunc.checkpoint.sharded import async_save_tree, load_tree, save_tree
from lmfunc.config.model import ConfigError
from lmfunc.tree import PyTree, local_tree_bytes

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "metadata.json"
IN_PROGRESS = ".lmfunc-in-progress"
CREATING, REMOVING = ".lmfunc-creating-", ".lmfunc-removing-"
"""Prefixes of the hidden names under which lmfunc makes an unfinished save and deletes a directory."""
BACKEND = "torch_dcp"
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")
_ANY_STEP_DIR = re.compile(r"^iter_\d+")


def step_dir_name(step: int) -> str:
    """``iter_0000100`` for step 100 (Megatron's ``iter_{:07d}``)."""
    return f"iter_{step:07d}"


class SaveFailed(RuntimeError):
    """A checkpoint save that did not complete (its message says why); the previous complete
    checkpoint and the tracker are untouched, and the unfinished directory is removed."""


def _no_space(err: BaseException) -> bool:
    """Whether ``err`` (or an error it carries: a cause, a DCP rank failure) is a full disk. A full
    disk inside ``torch.save``'s zip writer surfaces as "unexpected pos" without the errno."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left" in str(e) or "unexpected pos" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        for wrapped in (getattr(e, "failures", None) or {}).values():
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
    return False


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _marker(path: str) -> Optional[dict]:
    """The completion marker of checkpoint directory ``path`` as a dict; None when missing or unreadable."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _create_unfinished_save(tmp: str) -> None:
    """Create the directory ``tmp`` holding the in-progress marker: made and marked under a hidden
    name, then renamed, so a kill at any moment leaves either no ``tmp`` or a marked one."""
    staging = os.path.join(os.path.dirname(tmp), f"{CREATING}{os.path.basename(tmp)}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.mkdir(staging)
    open(os.path.join(staging, IN_PROGRESS), "w").close()
    os.rename(staging, tmp)


def _remove_own(path: str) -> None:
    """Delete the directory ``path``, which lmfunc wrote: renamed to a hidden name first, so that a
    kill during the deletion leaves no half-deleted entry under ``path``'s name."""
    trash = os.path.join(os.path.dirname(path), f"{REMOVING}{os.path.basename(path)}-{os.getpid()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:  # cannot rename (permissions): delete in place, as far as it goes
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def is_lmfunc_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete lmfunc checkpoint: its marker names lmfunc's DCP backend
    (a Megatron ``torch_dist`` checkpoint has a ``metadata.json`` too, with another backend)."""
    marker = _marker(path)
    return marker is not None and marker.get("sharded_backend") == BACKEND


def complete_steps(directory: str) -> list[int]:
    """Steps of the complete lmfunc checkpoints (``iter_*`` with lmfunc's marker) in ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match and is_lmfunc_checkpoint(os.path.join(directory, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def describe_foreign(path: str) -> str:
    """What the ``iter_*`` entry ``path`` (not a complete lmfunc checkpoint) looks like, for a message."""
    name = os.path.basename(path)
    if not os.path.isdir(path):
        return f"{name} (a file, not a checkpoint directory)"
    entries = sorted(os.listdir(path))
    legacy = [e for e in entries if e.startswith("mp_rank_") and os.path.isdir(os.path.join(path, e))]
    if legacy:
        inner = sorted(os.listdir(os.path.join(path, legacy[0])))
        return f"{name} (a Megatron legacy checkpoint: {legacy[0]}/{inner[0] if inner else ''})"
    marker = _marker(path)
    if marker is not None and marker.get("sharded_backend") not in (None, BACKEND):
        return f"{name} (a Megatron distributed checkpoint, sharded_backend {marker['sharded_backend']!r})"
    if name.endswith(".tmp"):
        return f"{name} (an unfinished save without lmfunc's {IN_PROGRESS} marker)"
    return f"{name} (no lmfunc {MARKER}: not a complete lmfunc checkpoint)"


def foreign_entries(directory: str) -> list[str]:
    """Descriptions of the ``iter_*`` entries of ``directory`` that lmfunc did not write: neither a
    complete lmfunc checkpoint nor an unfinished lmfunc save."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not _ANY_STEP_DIR.match(name) or is_lmfunc_checkpoint(path) or _is_unfinished_save(path):
            continue
        found.append(describe_foreign(path))
    return found


def check_save_dir(directory: str) -> None:
    """Raise ``ConfigError`` when ``directory`` holds ``iter_*`` entries lmfunc did not write: they
    would be mixed with lmfunc's saves (and Megatron's tracker file would be overwritten)."""
    found = foreign_entries(directory)
    if found:
        raise ConfigError(
            f"checkpoint save_dir {directory} holds checkpoints lmfunc cannot read: {'; '.join(found)}. "
            "lmfunc leaves them untouched: pass another --checkpoint.save-dir (or move them away)"
        )


def _is_unfinished_save(path: str) -> bool:
    """An ``iter_*.tmp`` directory of lmfunc's: in progress, or marked complete but not yet renamed."""
    return path.endswith(".tmp") and (os.path.isfile(os.path.join(path, IN_PROGRESS)) or is_lmfunc_checkpoint(path))


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
    """Delete lmfunc's unfinished saves in ``directory`` (``iter_*.tmp`` directories with the
    in-progress marker, and nothing else) and return their names; also delete what a kill left of
    lmfunc's own hidden directories (``CREATING``, ``REMOVING``)."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if _ANY_STEP_DIR.match(name) and _is_unfinished_save(path):
            _remove_own(path)
            removed.append(name)
        elif name.startswith((CREATING, REMOVING)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
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
            check_save_dir(directory)
            os.makedirs(directory, exist_ok=True)
            self.removed_partial = remove_partial(directory)
        self._pending: Optional[tuple[int, Future, Callable[[], None], int]] = None
        self.last_saved: Optional[int] = None
        self.damaged: set[int] = set()
        """Steps of checkpoints here known to be damaged (a resume skipped them): neither counted
        toward ``keep`` nor deleted by pruning, until a save of the same step replaces them."""

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
        error: Optional[BaseException] = None
        try:
            self.wait()
        except SaveFailed as err:  # the previous save failed on this rank (a commit fails on rank 0 alone)
            error = err
        tmp = self.path(step) + ".tmp"
        nbytes = local_tree_bytes(tree)
        if _rank() == 0 and error is None:
            try:
                if os.path.exists(tmp) and not _is_unfinished_save(tmp):
                    raise ConfigError(f"checkpoint save: {tmp} exists and was not written by lmfunc; move it away")
                _remove_own(tmp)
                _create_unfinished_save(tmp)
                for name, text in (files or {}).items():
                    with open(os.path.join(tmp, name), "w") as f:
                        f.write(text)
            except (OSError, ConfigError) as err:
                error = err
        self._agree(error, step, nbytes)

        def finish() -> None:
            if _rank() == 0:
                self._commit(step, tmp)
            self.last_saved = step

        if self.async_save:
            self._pending = (step, async_save_tree(tree, tmp, self.process_group, stage=stage), finish, nbytes)
        else:
            try:
                save_tree(tree, tmp, self.process_group)
                finish()
            except (Exception, CheckpointException) as err:
                raise self._failure(step, err, nbytes) from None

    def _agree(self, error: Optional[BaseException], step: int, nbytes: int) -> None:
        """Share every rank's outcome before a save's collectives (``error``: rank 0's failure to
        prepare the save, or the failure of this rank's previous save that ``wait`` found; None on
        success), so all ranks raise the same error (the lowest rank's) or all go on. A rank that
        went on alone would wait forever in the save's collectives, and one that raised alone would
        leave the others waiting in them. (Rank 0's commit of a background save can fail at another
        step than the other ranks look: there ``wait`` raises on rank 0 alone, which this shares; a
        failure found between saves, by ``in_flight``, reaches every rank through the trainer's
        per-step stop vote, ``StopRequests.should_stop``.)"""
        mine = None
        if isinstance(error, SaveFailed):
            mine = ("failed", str(error))
        elif isinstance(error, ConfigError):
            mine = ("config", str(error))
        elif error is not None:
            mine = ("failed", str(self._failure(step, error, nbytes)))
        outcomes = [mine]
        if dist.is_available() and dist.is_initialized():
            outcomes = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(outcomes, mine, group=self.process_group)
        first = next((outcome for outcome in outcomes if outcome is not None), None)
        if first is not None:
            kind, message = first
            raise (ConfigError if kind == "config" else SaveFailed)(message)

    def _failure(self, step: int, err: BaseException, nbytes: int) -> "SaveFailed":
        """The ``SaveFailed`` for a save of step ``step`` that raised ``err``, after removing its
        unfinished directory (rank 0): a full disk is named as such, with the bytes needed."""
        free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
        if _rank() == 0:
            _remove_own(self.path(step) + ".tmp")
        if _no_space(err) or free < nbytes:
            what = (f"no space left on {self.directory} (this process's part of the checkpoint needs about "
                    f"{nbytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB were free)")
        else:
            what = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        previous = self.latest()
        kept = (f"the previous checkpoint (step {previous}) and the tracker are intact" if previous is not None
                else "there is no earlier checkpoint")
        return SaveFailed(f"saving checkpoint step {step} to {self.directory} failed: {what}; {kept}")

    def _commit(self, step: int, tmp: str) -> None:
        """Marker, rename, tracker, then pruning: each later step only happens after the earlier."""
        marker = {"sharded_backend": BACKEND, "sharded_backend_version": 1, "iteration": step}
        _write_atomically(os.path.join(tmp, MARKER), json.dumps(marker) + "\n")
        os.remove(os.path.join(tmp, IN_PROGRESS))
        final = self.path(step)
        if os.path.exists(final):
            if not is_lmfunc_checkpoint(final):
                raise ConfigError(f"checkpoint save: {describe_foreign(final)} is in the way and was not written by lmfunc")
            _remove_own(final)
        os.rename(tmp, final)
        _write_atomically(os.path.join(self.directory, TRACKER), f"{step}\n")
        self.damaged.discard(step)
        if self.keep is not None:
            for old in [s for s in self.steps() if s not in self.damaged][:-self.keep]:
                if old != step:
                    _remove_own(self.path(old))

    def in_flight(self) -> Optional[int]:
        """The step of the background save still being written, if any (finishing a done one)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()
        return self._pending[0] if self._pending is not None else None

    def wait(self) -> None:
        """Block until the background save (if any) is written and committed; re-raise its error."""
        if self._pending is None:
            return
        step, future, finish, nbytes = self._pending
        self._pending = None
        try:
            future.result()
            finish()
        except (Exception, CheckpointException) as err:
            raise self._failure(step, err, nbytes) from None

    def restore(self, like: PyTree, step: int, allow_unused: bool = False) -> PyTree:
        """The checkpoint of ``step`` loaded into the layout of ``like`` (see ``load_tree``)."""
        path = self.path(step)
        if not is_lmfunc_checkpoint(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER}); complete steps in "
                                    f"{self.directory}: {self.steps() or 'none'}")
        return load_tree(like, path, self.process_group, allow_unused)

    def close(self) -> None:
        """Wait for the background save; the manager can still be used afterwards."""
        self.wait()
