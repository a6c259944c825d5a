"""The common (not sharded) state of a Megatron ``torch_dist`` save, where Megatron's training loop
puts its ``args``, ``iteration`` and the optimizer's unsharded state (its step count, the loss
scaler): ``common.pt`` beside the checkpoint files (megatron-core 0.16), or one pickled object
inside them (0.19). Either is read without running pickled code: a pickle can run any code, so only
plain data and Megatron's ``args`` Namespace are allowed."""

from __future__ import annotations

import io
import os
import re
from argparse import Namespace
from typing import Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lmfunc.config.model import ConfigError

COMMON = "common.pt"


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message; for DCP's ``CheckpointException``, of the first rank's
    underlying error."""
    if isinstance(err, CheckpointException) and getattr(err, "failures", None):
        failure = next(iter(err.failures.values()))  # (exception, its traceback's frames)
        err = failure[0] if isinstance(failure, tuple) else failure
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


COMMON_STATE = "common_state/shard_0_1"
"""Where megatron-core 0.19 keeps the common state instead of ``common.pt``: one pickled object in
the ``torch.distributed.checkpoint`` files (a one-element list holding the dict)."""


class _RawBytesPlanner(DefaultLoadPlanner):
    """A load planner that keeps a checkpoint's byte items as raw bytes: torch's default unpickles
    them with ``weights_only=False``, which would run any code a pickle holds."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = value.read()


def load_plain_data(data: Union[str, bytes]) -> object:
    """``torch.load`` of a file path or bytes without running pickled code: Megatron's ``args``
    Namespace is allowed, nothing else beyond plain data. Raises what ``torch.load`` raises
    (``unpickling_failure`` says it in a few words)."""
    with torch.serialization.safe_globals([Namespace]):
        return torch.load(data if isinstance(data, str) else io.BytesIO(data), map_location="cpu", weights_only=True)


def unpickling_failure(err: BaseException) -> str:
    """Why ``load_plain_data`` refused a pickle: 'the class X' it would have had to construct, or the
    error's first line."""
    needed = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    return f"the class {needed.group(1)}" if needed else first_line(err)


def _unpickled(data: Union[str, bytes], what: str) -> object:
    """``load_plain_data``, refused with a ``ConfigError`` naming ``what``."""
    try:
        return load_plain_data(data)
    except Exception as err:
        raise ConfigError(f"checkpoint.load_megatron: {what} holds objects beyond plain data and Megatron's args "
                          f"({unpickling_failure(err)}); lmfunc does not unpickle arbitrary classes, since a pickle can "
                          "run code. Give the model settings as flags instead and take the weights alone") from None


def common_source(directory: str) -> str:
    """Where a ``torch_dist`` save's common state is (``read_common``), for messages."""
    path = os.path.join(directory, COMMON)
    return path if os.path.exists(path) else f"{directory} ({COMMON_STATE})"


def read_common(directory: str) -> dict:
    """The common (not sharded) state of a ``torch_dist`` save, where Megatron's training loop puts
    its ``args``, ``iteration`` and the optimizer's unsharded state: ``common.pt`` (megatron-core
    0.16), or the ``common_state`` object inside the checkpoint files (0.19), loaded without
    running pickled code (``_unpickled``). megatron-core writes it with every save, before
    ``metadata.json``, so a save without it is incomplete and is refused."""
    path = os.path.join(directory, COMMON)
    if os.path.exists(path):
        return _unpickled(path, path)
    try:
        stored = FileSystemReader(directory).read_metadata().state_dict_metadata
    except (OSError, EOFError, RuntimeError, ValueError):
        stored = {}
    if COMMON_STATE not in stored:
        raise ConfigError(f"checkpoint.load_megatron: {path} is missing, and the checkpoint files hold no {COMMON_STATE} "
                          "either; megatron-core writes one of them with every torch_dist save, so this save is "
                          "incomplete or was copied without it. Copy the whole iter_NNNNNNN/ directory, or load an "
                          "earlier save")
    state = {COMMON_STATE: io.BytesIO()}
    try:
        dcp.load(state, storage_reader=FileSystemReader(directory), planner=_RawBytesPlanner(), no_dist=True)
    except (Exception, CheckpointException) as err:
        raise ConfigError(f"checkpoint.load_megatron: reading {COMMON_STATE} of {directory} failed: {first_line(err)}; "
                          "a shard file is missing or truncated") from None
    common = _unpickled(state[COMMON_STATE], f"{directory} ({COMMON_STATE})")
    if isinstance(common, (list, tuple)) and len(common) == 1:
        common = common[0]
    if not isinstance(common, dict):
        raise ConfigError(f"checkpoint.load_megatron: {COMMON_STATE} of {directory} holds a {type(common).__name__}, "
                          "not megatron-core's dict of common state")
    return common
