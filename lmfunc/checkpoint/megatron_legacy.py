"""Megatron-LM's legacy checkpoint format (``--ckpt-format torch``): one pickle per model-parallel
rank, ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt``, merged here into whole tensors.

Each file holds ``model`` (that rank's ``state_dict``: its tensor-parallel slices of its pipeline
stage's layers, numbered from 0 within the stage), ``args``, ``iteration`` and, unless saved without
them, ``optimizer``, ``opt_param_scheduler`` and ``rng_state``. A pickle can run code, so the files
are loaded with ``weights_only=True``, allowing Megatron's ``args`` (an ``argparse.Namespace``)
beyond plain data; a file that needs any other class is refused, naming it.

Tensor parallelism splits (megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``):
- along the output rows: ``linear_qkv`` (whole query groups per rank), ``linear_fc1`` (with SwiGLU
  each rank holds its slice of the gate, then its slice of the up projection), the word embeddings
  and the output layer (vocabulary-parallel), and these layers' biases;
- along the input columns: ``linear_proj`` and ``linear_fc2`` (their biases are whole on every rank);
- nothing else (norms, position embeddings): every rank holds all of it.
Mixture-of-experts, MLA and MTP models are read from saves without tensor or expert parallelism
(their pipeline stages are merged as above); a save that splits them over TP or EP ranks
(``mp_rank_TT_PPP_EEE``) is refused, with the conversion to ``torch_dist`` that reads at any layout.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import torch

from lmfunc.config.model import ConfigError, ModelConfig

FILE = "model_optim_rng.pt"
_ROWS = (".self_attention.linear_qkv.weight", ".self_attention.linear_qkv.bias", ".mlp.linear_fc1.weight",
         ".mlp.linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight")
"""Tensors split over tensor-parallel ranks along dim 0 (name suffixes)."""
_COLUMNS = (".self_attention.linear_proj.weight", ".mlp.linear_fc2.weight")
"""Tensors split along dim 1."""


def load_rank_file(path: str) -> dict[str, Any]:
    """One ``model_optim_rng.pt``, without running pickled code (module docstring)."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint.load_megatron: {path} does not exist") from None
    except Exception as err:
        text = str(err)
        needed = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        what = f"the class {needed.group(1)}" if needed else (text.strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            f"checkpoint.load_megatron: {path} needs {what} to load. lmfunc loads Megatron's pickles with "
            "weights_only=True (a pickle can run code) and allows only plain data and Megatron's args; re-save the "
            "checkpoint in the torch_dist format (Megatron: --ckpt-convert-format torch_dist) or as plain tensors") from None


def _rank_dirs(directory: str) -> dict[tuple[int, int], str]:
    """``{(tp, pp): path}`` of the ``mp_rank_*`` directories of one save."""
    found = {}
    for entry in sorted(os.listdir(directory)):
        match = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?", entry)
        if not match:
            continue
        if match.group(3):
            raise ConfigError(f"checkpoint.load_megatron: {directory}/{entry} is an expert-parallel save in the legacy "
                              f"format, which lmfunc does not merge; {_CONVERT}")
        found[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(directory, entry, FILE)
    tps, pps = {tp for tp, _ in found}, {pp for _, pp in found}
    if not found or found.keys() != {(tp, pp) for tp in range(len(tps)) for pp in range(len(pps))}:
        raise ConfigError(f"checkpoint.load_megatron: {directory} does not hold one mp_rank_TT[_PPP]/ per tensor- and "
                          f"pipeline-parallel rank (found {sorted(os.listdir(directory))})")
    return found


_CONVERT = ("convert it to torch_dist (Megatron: --ckpt-convert-format torch_dist), which lmfunc reads at any "
            "layout")


def _merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if name.endswith(_COLUMNS):
        return torch.cat(shards, dim=1)
    if name.endswith(_ROWS):
        if swiglu and ".mlp.linear_fc1." in name:
            halves = [shard.chunk(2, dim=0) for shard in shards]
            return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
        return torch.cat(shards, dim=0)
    return shards[0]


def read_legacy_model(directory: str, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model tensors of a legacy save (layers renumbered across pipeline stages) and the
    first rank file's other entries (``args``, ``iteration``, ...) for a model of ``cfg``'s
    architecture (with SwiGLU ``linear_fc1``'s tensor-parallel slices hold a gate and an up part)."""
    ranks = _rank_dirs(directory)
    tp_size, pp_size = max(tp for tp, _ in ranks) + 1, max(pp for _, pp in ranks) + 1
    swiglu = cfg.activation == "swiglu"
    if tp_size > 1 and (cfg.num_experts or cfg.multi_latent_attention or cfg.mtp_num_layers):
        raise ConfigError(f"checkpoint.load_megatron: {directory} splits an MoE, MLA or MTP model over {tp_size} "
                          f"tensor-parallel ranks in the legacy format, which lmfunc does not merge; {_CONVERT}")
    merged: dict[str, torch.Tensor] = {}
    first: dict[str, Any] = {}
    offset = 0
    for pp in range(pp_size):
        files = [load_rank_file(ranks[(tp, pp)]) for tp in range(tp_size)]
        if not first:
            first = {key: value for key, value in files[0].items() if key != "model"}
        states = []
        for tp, state in enumerate(files):
            if not isinstance(state.get("model"), dict):
                raise ConfigError(f"checkpoint.load_megatron: {ranks[(tp, pp)]} has no 'model' state dict (a save "
                                  "with virtual pipeline stages keeps model0, model1, ...: not read yet)")
            states.append({k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)})
        stage_layers = {int(m.group(1)) for k in states[0] for m in [re.match(r"decoder\.layers\.(\d+)\.", k)] if m}
        for name in states[0]:
            tensor = _merge_tp(name, [state[name] for state in states], swiglu)
            match = re.match(r"decoder\.layers\.(\d+)\.(.+)", name)
            if match:
                name = f"decoder.layers.{offset + int(match.group(1))}.{match.group(2)}"
            if name == "output_layer.weight" and pp != pp_size - 1:
                continue
            merged.setdefault(name, tensor)
        offset += len(stage_layers)
    return merged, first
