"""Megatron-LM's legacy checkpoint format (``--ckpt-format torch``): one pickle per model-parallel
rank, ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, merged here into whole tensors.

Each file holds ``model`` (that rank's ``state_dict``: its tensor-parallel slices of its pipeline
stage's layers, numbered from 0 within the stage), ``args``, ``iteration`` and, unless saved without
them, ``optimizer``, ``opt_param_scheduler`` and ``rng_state``. A pickle can run code, so the files
are loaded with ``weights_only=True``, allowing Megatron's ``args`` (an ``argparse.Namespace``)
beyond plain data; a file that needs any other class is refused, naming it.

Tensor parallelism splits (megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``):
- along the output rows: ``linear_qkv`` (whole query groups per rank), MLA's query and key-value
  projections (down and up), every MLP's ``linear_fc1`` (dense, shared and routed experts; with
  SwiGLU each rank holds its slice of the gate, then its slice of the up projection), MTP's
  ``eh_proj``, the word embeddings and the output layer (vocabulary-parallel), and these layers' biases;
- along the input columns: ``linear_proj`` and every ``linear_fc2`` (their biases are whole on every rank);
- nothing else (norms, the router, position embeddings): every rank holds all of it.
Expert parallelism (``mp_rank_TT[_PPP]_EEE``): each expert-parallel rank holds ``E / EP`` of every
MoE layer's routed experts, numbered from 0 on that rank; rank ``r``'s expert ``i`` is expert
``r E / EP + i``. The sequential experts (``local_experts.<i>.*``) and Transformer Engine's grouped
ones (``linear_fc1.weight<i>``) are renumbered; the legacy grouped GEMM's ``weight1``
(``[E_local, h, 2f]`` in memory) and ``weight2`` (``[E_local f, h]``) are joined along the experts.
Everything else (attention, the router, the shared expert) is whole on every expert-parallel rank.
A save that splits the legacy grouped GEMM's experts over TP ranks is refused, with the conversion
to ``torch_dist`` that reads at any layout.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from lmfunc.checkpoint.megatron_common import load_plain_data, unpickling_failure
from lmfunc.config.model import ConfigError, ModelConfig

FILE = "model_optim_rng.pt"
_ROWS = re.compile(r"(\.linear_qkv\.(weight|bias)|\.linear_fc1\.(weight|bias)\d*|\.linear_q(_down|_up)?_proj\.weight"
                   r"|\.linear_kv_(down|up)_proj\.weight|\.eh_proj\.weight|^embedding\.word_embeddings\.weight"
                   r"|^output_layer\.weight)$")
"""Tensors split over tensor-parallel ranks along dim 0 (column-parallel layers): attention's
``linear_qkv`` and MLA's projections, every MLP's ``linear_fc1`` (dense, shared and routed experts,
TE's grouped ``linear_fc1.weight<e>`` too), MTP's ``eh_proj``, the vocabulary-parallel embedding
and output layer."""
_COLUMNS = re.compile(r"\.(linear_proj|linear_fc2)\.weight\d*$")
"""Tensors split along dim 1 (row-parallel layers): attention's ``linear_proj`` and every MLP's ``linear_fc2``."""


def load_rank_file(path: str) -> dict[str, Any]:
    """One ``model_optim_rng.pt``, without running pickled code (module docstring)."""
    try:
        return load_plain_data(path)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint.load_megatron: {path} does not exist") from None
    except Exception as err:
        raise ConfigError(
            f"checkpoint.load_megatron: {path} needs {unpickling_failure(err)} to load. lmfunc loads Megatron's pickles with "
            "weights_only=True (a pickle can run code) and allows only plain data and Megatron's args; re-save the "
            "checkpoint in the torch_dist format (Megatron: --ckpt-convert-format torch_dist) or as plain tensors") from None


def _rank_dirs(directory: str) -> dict[tuple[int, ...], str]:
    """``{(tp,): path}``, ``{(tp, pp or ep): path}`` or ``{(tp, pp, ep): path}`` of the ``mp_rank_*``
    directories of one save, as their names number them (``_rank_layout`` tells a pipeline rank from
    an expert-parallel one in the two-number names)."""
    found = {}
    for entry in sorted(os.listdir(directory)):
        match = re.fullmatch(r"mp_rank_(\d{2})((?:_\d{3}){0,2})", entry)
        if match:
            found[(int(match.group(1)), *map(int, re.findall(r"\d{3}", match.group(2))))] = os.path.join(directory, entry, FILE)
    if not found or len({len(key) for key in found}) != 1:
        raise ConfigError(f"checkpoint.load_megatron: {directory} does not hold one mp_rank_TT[_PPP][_EEE]/ per tensor-, "
                          f"pipeline- and expert-parallel rank (found {sorted(os.listdir(directory))})")
    return found


def _rank_layout(directory: str, files: dict[tuple[int, ...], tuple[str, dict]]) -> dict[tuple[int, int, int], tuple[str, dict]]:
    """``files`` (``_rank_dirs``' numbers -> (path, loaded file)) by (tp, pp, ep) rank. Megatron names
    a rank ``mp_rank_TT_PPP`` with pipeline parallelism alone and ``mp_rank_TT_EEE`` with expert
    parallelism alone; its ``args`` say which (``expert_model_parallel_size``). Without them:
    expert-parallel ranks hold the same state-dict keys (each numbers its experts from 0), pipeline
    stages do not (the first holds the embedding, the last the output layer)."""
    if next(len(key) for key in files) == 2:
        args = next(iter(files.values()))[1].get("args")
        if getattr(args, "expert_model_parallel_size", None) is not None:
            expert = args.expert_model_parallel_size > 1 and getattr(args, "pipeline_model_parallel_size", 1) == 1
        else:
            expert = len({frozenset(state.get("model") or {}) for _, state in files.values()}) == 1
        layout = {(tp, 0, rank) if expert else (tp, rank, 0): file for (tp, rank), file in files.items()}
    else:
        layout = {(key + (0, 0))[:3]: file for key, file in files.items()}
    sizes = [len({key[i] for key in layout}) for i in range(3)]
    if layout.keys() != {(tp, pp, ep) for tp in range(sizes[0]) for pp in range(sizes[1]) for ep in range(sizes[2])}:
        raise ConfigError(f"checkpoint.load_megatron: {directory} does not hold one mp_rank_TT[_PPP][_EEE]/ per tensor-, "
                          f"pipeline- and expert-parallel rank (found {sorted(os.listdir(directory))})")
    return layout


_CONVERT = ("convert it to torch_dist (Megatron: --ckpt-convert-format torch_dist), which lmfunc reads at any "
            "layout")


def _merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The whole tensor ``name`` from its tensor-parallel ``shards`` (with SwiGLU each ``linear_fc1``
    shard holds its slice of the gate, then its slice of the up projection)."""
    if len(shards) == 1:
        return shards[0]
    if _COLUMNS.search(name):
        return torch.cat(shards, dim=1)
    if _ROWS.search(name):
        if swiglu and ".linear_fc1." in name:
            halves = [shard.chunk(2, dim=0) for shard in shards]
            return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
        return torch.cat(shards, dim=0)
    return shards[0]


_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(?:local_experts\.(\d+)(\..+)|(linear_fc[12]\.(?:weight|bias))(\d+))")
"""A routed expert's tensor in a rank's numbering: the sequential experts' ``local_experts.<i>.<rest>``
or Transformer Engine's grouped ``linear_fc1.weight<i>``."""


def _merge_ep(states: list[dict[str, torch.Tensor]], local_experts: int) -> dict[str, torch.Tensor]:
    """One pipeline stage's state dict from its expert-parallel ranks' ``states`` (module docstring)."""
    if len(states) == 1:
        return states[0]
    merged: dict[str, torch.Tensor] = {}
    for rank, state in enumerate(states):
        for name, tensor in state.items():
            match = _LOCAL_EXPERT.fullmatch(name)
            if match and match.group(2) is not None:
                merged[f"{match.group(1)}local_experts.{rank * local_experts + int(match.group(2))}{match.group(3)}"] = tensor
            elif match:
                merged[f"{match.group(1)}{match.group(4)}{rank * local_experts + int(match.group(5))}"] = tensor
            elif name.endswith(".mlp.experts.weight1") and rank == 0:  # [h, E_local 2f] viewing [E_local, h, 2f]
                parts = [other[name].view(local_experts, other[name].shape[0], -1) for other in states]
                merged[name] = torch.cat(parts).view(tensor.shape[0], -1)
            elif name.endswith(".mlp.experts.weight2") and rank == 0:  # [E_local f, h]
                merged[name] = torch.cat([other[name] for other in states])
            elif name.endswith((".mlp.experts.weight1", ".mlp.experts.weight2")):
                continue  # joined over every rank above
            else:
                merged.setdefault(name, tensor)
    return merged


def read_legacy_model(directory: str, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model tensors of a legacy save (layers renumbered across pipeline stages) and the
    first rank file's other entries (``args``, ``iteration``, ...) for a model of ``cfg``'s
    architecture (with SwiGLU ``linear_fc1``'s tensor-parallel slices hold a gate and an up part)."""
    ranks = _rank_layout(directory, {key: (path, load_rank_file(path)) for key, path in _rank_dirs(directory).items()})
    tp_size, pp_size, ep_size = (max(key[i] for key in ranks) + 1 for i in range(3))
    swiglu = cfg.activation == "swiglu"
    if ep_size > 1 and (not cfg.num_experts or cfg.num_experts % ep_size):
        raise ConfigError(f"checkpoint.load_megatron: {directory} splits the routed experts over {ep_size} expert-parallel "
                          f"ranks, which does not divide the model's model.num_experts ({cfg.num_experts}); pass the "
                          "Megatron run's --model.num-experts")
    if tp_size > 1 and any(name.endswith((".experts.weight1", ".experts.weight2"))
                           for _, state in ranks.values() for name in state.get("model") or {}):
        raise ConfigError(f"checkpoint.load_megatron: {directory} splits the legacy grouped GEMM's experts (weight1, "
                          f"weight2) over {tp_size} tensor-parallel ranks, which lmfunc does not merge; {_CONVERT}")
    merged: dict[str, torch.Tensor] = {}
    first: dict[str, Any] = {}
    offset = 0
    for pp in range(pp_size):
        states = []
        for tp in range(tp_size):
            ep_states = []
            for ep in range(ep_size):
                path, state = ranks[(tp, pp, ep)]
                if not first:
                    first = {key: value for key, value in state.items() if key != "model"}
                if not isinstance(state.get("model"), dict):
                    raise ConfigError(f"checkpoint.load_megatron: {path} has no 'model' state dict (a save with "
                                      "virtual pipeline stages keeps model0, model1, ...: not read yet)")
                ep_states.append({k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)})
            states.append(_merge_ep(ep_states, (cfg.num_experts or ep_size) // ep_size))
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
