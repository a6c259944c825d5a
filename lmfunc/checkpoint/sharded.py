"""Any pytree of tensors as a ``torch.distributed.checkpoint`` (DCP) directory.

Each leaf is stored under its dotted path (``params.layers.0.attn.wq``, ``opt_state.0.mu.embed.tokens``,
``step``), so a checkpoint is a flat, readable key space. DTensor leaves are written shard by shard,
every rank writing its own ``__<rank>_0.distcp`` file; plain tensors count as replicated and are
written once. Loading fills a *like* tree that has the target layout, so a checkpoint saved on one
mesh loads on any other (DCP reads the overlapping pieces of each saved shard).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmfunc.tree import PyTree, flatten_with_paths, tree_flatten, tree_leaves, tree_map, tree_unflatten

# DCP warns on every single-process save/load (including those on its background thread) that it
# assumes a single process; that is the intent here, so the warning is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def to_state_dict(tree: PyTree) -> dict[str, torch.Tensor]:
    """``{dotted_path: leaf}`` of every leaf of ``tree`` (the keys DCP stores)."""
    return dict(flatten_with_paths(tree))


class _Unstaged:
    """DCP's ``AsyncStager`` protocol without a copy of its own: ``async_save_tree`` either writes
    tensors that nobody modifies meanwhile, or has already copied them (``stage=True``)."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save_tree(tree: PyTree, path: str, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Write ``tree`` to the directory ``path`` (a collective: every rank calls it with its shards)."""
    dcp.save(to_state_dict(tree), checkpoint_id=path, process_group=process_group, no_dist=not _distributed())


def stage_tree(tree: PyTree) -> PyTree:
    """A copy of every tensor leaf of ``tree`` (DTensors shard by shard, on the same device)."""
    return tree_map(lambda leaf: leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf, tree)


def async_save_tree(tree: PyTree, path: str, process_group: Optional[dist.ProcessGroup] = None,
                    stage: bool = False) -> Future:
    """Start writing ``tree`` to ``path`` on a background thread and return its future.

    stage: copy the tensors first (``stage_tree``), so the caller may overwrite them in place (a
        train step built with ``donate_state=True``) while the write runs; the copy lives until the
        write is done. Without it the caller must not modify the tensors of ``tree`` in place until
        the future is done.
    With several ranks, ``process_group`` should be a group used by nothing else (the write runs
    collectives); it needs a CPU backend (gloo), which DCP's background write requires. Tensors on a
    GPU are staged by DCP's own stager, a copy into host memory made before this returns, so a save
    never holds a second copy of the state in GPU memory."""
    on_accelerator = any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu" for leaf in tree_leaves(tree))
    if stage and on_accelerator:
        return dcp.async_save(to_state_dict(tree), checkpoint_id=path, process_group=process_group,
                              no_dist=not _distributed())
    if stage:
        tree = stage_tree(tree)
    return dcp.async_save(to_state_dict(tree), checkpoint_id=path, process_group=process_group,
                          async_stager=_Unstaged(), no_dist=not _distributed())


class DamagedCheckpoint(Exception):
    """A checkpoint whose files are missing or unreadable (a lost shard, a truncated file, a missing
    or corrupt ``.metadata``); the message names the file and the failure."""


def _failure_summary(err: BaseException) -> str:
    """One line per failed rank of a DCP ``CheckpointException`` (else the error itself)."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(err).__name__}: {err}".strip()
    parts = []
    for rank, wrapped in sorted(failures.items()):
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, OSError) and inner.filename:
            text = f"{inner.strerror}: {inner.filename}"
        else:
            text = str(inner).strip() or ("a file ends early (truncated)" if isinstance(inner, EOFError) else "")
        parts.append(f"rank {rank}: {type(inner).__name__}: {text}")
    return "; ".join(parts)


def saved_tensors(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of the tensors stored in the DCP directory ``path``; raises
    ``DamagedCheckpoint`` when its ``.metadata`` is missing or unreadable."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path} has no DCP .metadata file") from None
    except Exception as err:  # a truncated or overwritten pickle fails in many ways
        raise DamagedCheckpoint(f"{path}/.metadata cannot be read ({type(err).__name__}: {err})") from None
    return {key: (tuple(entry.size), entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}


def check_compatible(like: PyTree, path: str, allow_unused: bool = False) -> None:
    """Raise ``ValueError`` naming every leaf of ``like`` that ``path`` lacks or stores with another
    shape, and (unless ``allow_unused``) every stored tensor that ``like`` has no place for."""
    saved = saved_tensors(path)
    expected = {name: tuple(leaf.shape) for name, leaf in flatten_with_paths(like)}
    missing = sorted(set(expected) - set(saved))
    unused = [] if allow_unused else sorted(set(saved) - set(expected))
    wrong = [f"{name}: checkpoint {saved[name][0]}, expected {expected[name]}"
             for name in sorted(set(expected) & set(saved)) if saved[name][0] != expected[name]]
    if missing or unused or wrong:
        parts = [f"missing from the checkpoint: {missing}" if missing else "",
                 f"in the checkpoint but not expected: {unused}" if unused else "",
                 f"different shapes: {wrong}" if wrong else ""]
        raise ValueError(f"checkpoint {path} does not match: " + "; ".join(p for p in parts if p))


def load_tree(like: PyTree, path: str, process_group: Optional[dist.ProcessGroup] = None,
              allow_unused: bool = False) -> PyTree:
    """``like`` filled in place from the DCP directory ``path`` and returned (a collective).

    ``like`` gives the names, shapes, dtypes and layout (plain tensors or DTensors on any mesh) of
    the result; stored values are resharded to it. ``allow_unused`` permits loading a part of the
    checkpoint (e.g. only ``params``). Mismatched names or shapes raise ``ValueError`` up front;
    missing or unreadable files raise ``DamagedCheckpoint`` (on every rank: DCP gathers failures).
    """
    check_compatible(like, path, allow_unused)
    _, spec = tree_flatten(like)
    state_dict = to_state_dict(like)
    try:
        dcp.load(state_dict, checkpoint_id=path, process_group=process_group, no_dist=not _distributed())
    except CheckpointException as err:  # a BaseException subclass in torch
        raise DamagedCheckpoint(f"{path}: {_failure_summary(err)}") from None
    return tree_unflatten(list(state_dict.values()), spec)
