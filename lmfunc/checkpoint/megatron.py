"""Megatron-LM checkpoints on disk: read and write the ``torch_dist`` format (Megatron's default,
``--ckpt-format torch_dist``) without megatron-core.

A Megatron save directory holds ``latest_checkpointed_iteration.txt`` (an iteration or ``release``)
and one directory per save, ``iter_NNNNNNN/`` (or ``release/``). A ``torch_dist`` one holds
``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the state that is
not sharded: Megatron's training loop puts its ``args`` and ``iteration`` there) and the files of
``torch.distributed.checkpoint``. Every tensor is stored whole (its global shape), whatever TP/PP/EP
layout saved it, under its ``sharded_state_dict`` key, named in Transformer Engine's spelling
(``lmfunc.checkpoint.megatron_layout``). The layers are stacked along a leading axis,
``decoder.layers.<name>`` ``[L, ...]``, when they are all alike; a model that mixes dense and MoE
layers (``--moe-layer-freq`` a pattern or above 1) keeps them one by one, ``decoder.layers.<i>.<name>``.
Routed experts are stacked along the next axis (``[L, E, ...]`` or ``[E, ...]``). So one process
reads any layout's save by key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from argparse import Namespace
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmfunc.checkpoint.megatron_args import flag, megatron_arguments, mismatches, model_settings
from lmfunc.checkpoint.megatron_common import COMMON, common_source, first_line, read_common
from lmfunc.checkpoint.megatron_layout import (
    EXPERTS, from_megatron_layers, local_spec_aliases, newer_megatron_aliases, to_megatron_layers,
)
from lmfunc.checkpoint.megatron_legacy import FILE as LEGACY_FILE
from lmfunc.checkpoint.megatron_legacy import load_rank_file, read_legacy_model
from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.tree import PyTree

TRACKER = "latest_checkpointed_iteration.txt"
"""The file in a Megatron save directory that names its newest save."""
METADATA = "metadata.json"
TORCH_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}
"""``metadata.json`` as megatron-core writes it for a ``torch_dist`` save."""
LAYERS_PREFIX = "decoder.layers."
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
"""Keys of the model's tensors in a ``torch_dist`` save (optimizer and RNG state have others)."""


def iteration_dir(path: str) -> str:
    """The directory of one save: ``path`` itself when it is one (``iter_NNNNNNN/``, ``release/``, or
    any folder holding ``metadata.json`` or ``mp_rank_*/``, as megatron-core's
    ``dist_checkpointing.save`` writes), else the newest save of the Megatron save directory
    ``path`` (its ``latest_checkpointed_iteration.txt``, or its last ``iter_NNNNNNN/``)."""
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint.load_megatron: {path} is not a directory")
    tracker = os.path.join(path, TRACKER)
    if os.path.exists(tracker):
        text = _tracker_text(tracker)
        name = _save_name(text)
        if name is None:
            raise ConfigError(f"checkpoint.load_megatron: {tracker} holds {text!r}, neither an iteration nor 'release'")
        found = os.path.join(path, name)
        if not os.path.isdir(found):
            raise ConfigError(f"checkpoint.load_megatron: {tracker} names {name}, but {found} does not exist")
        return found
    if (re.fullmatch(r"iter_\d{7}|release", os.path.basename(os.path.normpath(path)))
            or os.path.exists(os.path.join(path, METADATA)) or any(entry.startswith("mp_rank_") for entry in os.listdir(path))):
        return path
    saves = sorted(entry for entry in os.listdir(path) if re.fullmatch(r"iter_\d{7}", entry))
    if saves:
        return os.path.join(path, saves[-1])
    raise ConfigError(f"checkpoint.load_megatron: {path} is neither a Megatron save directory (no {TRACKER}, no "
                      "iter_NNNNNNN/) nor one save (iter_NNNNNNN/ or release/)")


def _tracker_text(tracker: str) -> str:
    """The stripped text of a tracker file (``latest_checkpointed_iteration.txt``)."""
    with open(tracker) as f:
        return f.read().strip()


def _save_name(tracker_text: str) -> Optional[str]:
    """The save a tracker file's text names: ``release``, ``iter_NNNNNNN``, or None for other text."""
    if tracker_text == "release":
        return "release"
    return f"iter_{int(tracker_text):07d}" if tracker_text.isdigit() else None


def checkpoint_format(directory: str) -> str:
    """'torch_dist' or 'torch' (legacy ``mp_rank_*``) for one save directory."""
    if os.path.exists(os.path.join(directory, METADATA)):
        with open(os.path.join(directory, METADATA)) as f:
            try:
                backend = json.load(f).get("sharded_backend")
            except json.JSONDecodeError as err:
                raise ConfigError(f"checkpoint.load_megatron: {directory}/{METADATA} is not valid JSON: {err}") from None
        if backend != "torch_dist":
            raise ConfigError(f"checkpoint.load_megatron: {directory} is a {backend!r} save; lmfunc reads 'torch_dist' "
                              "and the legacy 'torch' format (Megatron's --ckpt-format)")
        return "torch_dist"
    if any(entry.startswith("mp_rank_") for entry in os.listdir(directory)):
        return "torch"
    raise ConfigError(f"checkpoint.load_megatron: {directory} holds neither {METADATA} (torch_dist) nor mp_rank_*/ "
                      "(the legacy torch format)")


def torch_dist_keys(directory: str) -> dict[str, TensorStorageMetadata]:
    """The tensor entries of a ``torch_dist`` save's metadata: ``{key: its size and dtype}``."""
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except (OSError, EOFError, RuntimeError, ValueError) as err:
        raise ConfigError(f"checkpoint.load_megatron: {directory}/.metadata cannot be read ({err}); the save is "
                          "incomplete or damaged") from None
    return {key: meta for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}


def read_torch_dist_model(directory: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model tensors of a ``torch_dist`` save (with ``prefix``: the optimizer's tensors of that
    name, ``optimizer.state.exp_avg.`` ..., keyed like the model's), whole and with the layers
    unstacked: ``decoder.layers.<i>.<name>`` for each stacked ``decoder.layers.<name>`` ``[L, ...]``
    (a save that keeps its layers one by one already names them so)."""
    wanted = {key.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in torch_dist_keys(directory).items()
              if key.startswith(prefix) and key.removeprefix(prefix).startswith(MODEL_PREFIXES)}
    if not wanted:
        raise ConfigError(f"checkpoint.load_megatron: {directory} holds no {'model' if not prefix else prefix} tensors "
                          f"(no keys under {', '.join(prefix + name for name in MODEL_PREFIXES)})")
    try:
        dcp.load({prefix + key: tensor for key, tensor in wanted.items()}, storage_reader=FileSystemReader(directory),
                 no_dist=True)
    except (Exception, CheckpointException) as err:  # DCP reports a short or missing shard file as a BaseException
        raise ConfigError(f"checkpoint.load_megatron: reading {directory} failed: {first_line(err)}; a shard file "
                          "is missing or truncated") from None
    out: dict[str, torch.Tensor] = {}
    for key, tensor in wanted.items():
        rest = key.removeprefix(LAYERS_PREFIX)
        if key.startswith(LAYERS_PREFIX) and not rest.split(".", 1)[0].isdigit():
            for i, layer in enumerate(tensor.unbind(0)):
                out[f"{LAYERS_PREFIX}{i}.{rest}"] = layer
        else:
            out[key] = tensor
    return out


def write_torch_dist_model(tensors: dict[str, torch.Tensor], path: str, iteration: Optional[int] = None,
                           common: Optional[dict] = None, stack_layers: bool = True, overwrite: bool = False) -> str:
    """Write Megatron-named, per-layer ``tensors`` (``decoder.layers.<i>.*``) as a ``torch_dist``
    save under the save directory ``path``: ``iter_NNNNNNN/`` (``release/`` when ``iteration`` is
    None) with ``metadata.json``, ``common.pt`` and the tracker file. Returns the save's directory.
    ``stack_layers``: store the layers stacked ``[L, ...]`` (megatron-core's layout when they are all
    alike), else one by one (its layout for a mix of dense and MoE layers).

    Megatron stores each linear module's extra state (Transformer Engine's FP8 metadata; None
    without TE) as pickled objects beside its weight, one per layer and expert,
    ``<module>._extra_state/shard_<offsets>_<sizes>``, and refuses a save without them; each is
    written here as None, the state of a module that has not run in FP8 (``_extra_states``).

    A save directory that already holds files, or a tracker file that names another save, is
    replaced only with ``overwrite`` (``_clear_for_save``)."""
    name = "release" if iteration is None else f"iter_{iteration:07d}"
    directory = os.path.join(path, name)
    _clear_for_save(path, name, overwrite)
    os.makedirs(directory, exist_ok=True)
    stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
    flat: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key) if stack_layers else None
        if match:
            stacked.setdefault(match.group(2), []).append((int(match.group(1)), tensor))
        else:
            flat[key] = tensor.contiguous()
    num_layers = 0
    for rest, layers in stacked.items():
        layers.sort(key=lambda item: item[0])
        flat[LAYERS_PREFIX + rest] = torch.stack([tensor for _, tensor in layers])
        num_layers = len(layers)
    dcp.save({**flat, **_extra_states(flat, num_layers)}, checkpoint_id=directory, no_dist=True)
    torch.save(common or {}, os.path.join(directory, COMMON))
    with open(os.path.join(directory, METADATA), "w") as f:
        json.dump(TORCH_DIST_METADATA, f)
    with open(os.path.join(path, TRACKER), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return directory


def _clear_for_save(path: str, name: str, overwrite: bool) -> None:
    """Make way for the save ``name`` (``release`` or ``iter_NNNNNNN``) under ``path``. Without
    ``overwrite``, raise ``ConfigError`` when ``path/name`` holds files or ``path``'s tracker file
    names another save: the write would mix its shards with another save's, or point a Megatron run
    resuming from ``path`` at this save instead of its own. With it, remove the files a
    ``torch_dist`` save consists of from ``path/name`` (shards of a save on more ranks than this
    one would otherwise stay beside it); anything else there is left alone."""
    directory, tracker = os.path.join(path, name), os.path.join(path, TRACKER)
    existing = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    named = _tracker_text(tracker) if os.path.isfile(tracker) else None
    if not overwrite and (existing or (named is not None and _save_name(named) != name)):
        found = f"{directory} holds {len(existing)} files (e.g. {existing[0]})" if existing else \
            f"{tracker} names the save {named!r}, which this write would replace as the one to resume from"
        raise ConfigError(f"writing a Megatron save to {path}: {found}; pick another folder, or pass "
                          "overwrite=True (--overwrite for lmfunc.export) to replace it")
    for entry in existing:
        if entry.endswith(".distcp") or entry in (".metadata", COMMON, METADATA):
            os.remove(os.path.join(directory, entry))


def _extra_states(flat: dict[str, torch.Tensor], num_layers: int) -> dict[str, list]:
    """The ``_extra_state`` objects of the linear modules (``linear_*``, ``eh_proj``) among the
    saved ``flat`` tensors, keyed as megatron-core's ``ShardedObject``s: the offsets and sizes of
    the stacked layer axis (``num_layers``) and the expert axis, ``shard_0_1`` when there is neither."""
    out = {}
    for key, tensor in flat.items():
        match = re.fullmatch(r"(.*\.(?:linear_\w+|eh_proj))\.weight", key)
        if not match:
            continue
        axes = [num_layers] if key.startswith(LAYERS_PREFIX) and not key[len(LAYERS_PREFIX):][0].isdigit() else []
        if EXPERTS in key:
            axes.append(tensor.shape[len(axes)])
        offsets = [()]
        for size in axes:
            offsets = [(*offset, i) for offset in offsets for i in range(size)]
        for offset in offsets:
            index, sizes = (offset, axes) if axes else ((0,), [1])
            shard = f"shard_{'.'.join(map(str, index))}_{'.'.join(map(str, sizes))}"
            out[f"{match.group(1)}._extra_state/{shard}"] = _sharded_object(None)
    return out


def _sharded_object(value: object) -> list:
    """One Megatron ``ShardedObject`` as DCP stores it: the list of the objects under its key (here
    one), which DCP's planner saves as one ``torch.save`` blob, as megatron-core's does (DCP keeps
    a list of non-tensors whole)."""
    return [value]



@dataclasses.dataclass(frozen=True)
class MegatronCheckpoint:
    """What ``load_megatron`` read: the params and where Megatron's run stood."""

    params: PyTree
    """lmfunc params (fp32), ``cfg``'s tree."""
    directory: str
    """The save that was read (``iter_NNNNNNN/`` or ``release/``)."""
    format: str
    """'torch_dist' or 'torch' (legacy)."""
    iteration: Optional[int]
    """Megatron's iteration at the save (None when the save holds none, as megatron-core's own)."""
    args: Optional[Namespace]
    """Megatron's training arguments (None when the save holds none)."""


def load_megatron(path: str, cfg: ModelConfig) -> MegatronCheckpoint:
    """lmfunc params from a Megatron checkpoint: a save directory (its newest save) or one
    ``iter_NNNNNNN/``, in the ``torch_dist`` or the legacy format, any TP/PP layout. When the save
    holds Megatron's ``args``, the model they describe must be ``cfg``'s (else ``ConfigError`` lists
    the flags to pass); without them, every tensor's shape is checked against ``cfg``."""
    directory = iteration_dir(path)
    kind = checkpoint_format(directory)
    if kind == "torch_dist":
        other = read_common(directory)
        tensors = read_torch_dist_model(directory)
        source = common_source(directory)
    else:
        tensors, other = read_legacy_model(directory, cfg)
        source = f"{directory}/mp_rank_00*/model_optim_rng.pt"
    args = other.get("args")
    if args is not None:
        settings = model_settings(args, source)
        differing = mismatches(settings, cfg)
        if differing:
            raise ConfigError(
                f"{source} holds a Megatron model that differs from the model config: "
                + "; ".join(f"{name} is {theirs} there, {ours} here" for name, (theirs, ours) in differing.items())
                + ". To import it, pass " + " ".join(flag(name, theirs) for name, (theirs, _) in differing.items()))
    params = from_megatron_layers(tensors, cfg, directory)
    iteration = other.get("iteration")
    return MegatronCheckpoint(params, directory, kind, int(iteration) if iteration is not None else None, args)


def run_record(directory: str) -> tuple[dict, str]:
    """What a save directory (``iter_NNNNNNN/`` or ``release/``) holds besides the model's tensors, and
    the file it came from: ``common.pt`` of a ``torch_dist`` save, or the first rank's legacy file less
    its ``model`` (Megatron's training loop writes ``args``, ``iteration`` and the optimizer's
    unsharded state, its loss scaler included, there)."""
    if checkpoint_format(directory) == "torch_dist":
        return read_common(directory), common_source(directory)
    source = os.path.join(directory, sorted(e for e in os.listdir(directory) if e.startswith("mp_rank_"))[0], LEGACY_FILE)
    return {key: value for key, value in load_rank_file(source).items() if key != "model"}, source


def megatron_run_state(path: str) -> tuple[Optional[int], Optional[Namespace], str]:
    """(Megatron's iteration, its ``args``, the file they came from) of the save ``path`` names
    (``iteration_dir``); None for what the save does not hold. A ``release`` save has no
    iteration."""
    directory = iteration_dir(path)
    other, source = run_record(directory)
    iteration = other.get("iteration")
    release = os.path.basename(os.path.normpath(directory)) == "release"
    return (None if release or iteration is None else int(iteration)), other.get("args"), source


ARGUMENTS_FILE = "megatron_args.txt"
"""The Megatron arguments of an exported model, written beside its save."""


def save_megatron(params: PyTree, cfg: ModelConfig, path: str, iteration: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None, overwrite: bool = False) -> str:
    """Write full ``params`` as a Megatron ``torch_dist`` save under ``path`` (``release/``, or
    ``iter_NNNNNNN/`` for an ``iteration``) with the tracker file, and ``path/megatron_args.txt``:
    the arguments that build the matching megatron-core ``GPTModel`` (``megatron_arguments``).
    megatron-core's ``dist_checkpointing.load`` reads it into such a model at any TP/PP layout.
    An existing save there is replaced only with ``overwrite`` (``write_torch_dist_model``).
    Returns the save's directory."""
    tensors = {name: tensor.to(dtype or tensor.dtype) for name, tensor in to_megatron_layers(params, cfg).items()}
    tensors |= local_spec_aliases(tensors, cfg)
    tensors |= newer_megatron_aliases(tensors)
    common = {"checkpoint_version": 3.0} | ({"iteration": iteration} if iteration is not None else {})
    # megatron-core stacks the layers unless --moe-layer-freq is a pattern (megatron_arguments
    # writes one for any model that mixes dense and MoE layers).
    directory = write_torch_dist_model(tensors, path, iteration, common, overwrite=overwrite,
                                       stack_layers=cfg.num_experts is None or all(cfg.moe_layers))
    with open(os.path.join(path, ARGUMENTS_FILE), "w") as f:
        f.write(" \\\n".join(argument for argument in megatron_arguments(cfg) if not argument.startswith("#")) + "\n")
        f.write("".join(f"{argument}\n" for argument in megatron_arguments(cfg) if argument.startswith("#")))
    return directory
