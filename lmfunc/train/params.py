"""A run's initial parameters: ``model.init`` on one process, made straight into shards on a mesh
(``parallel.sharding.init_sharded`` over the model's leaf specs)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from lmfunc import model
from lmfunc.config import ModelConfig
from lmfunc.model import gpt
from lmfunc.parallel.sharding import DEFAULT_RULES, Rules, init_sharded, shard_params
from lmfunc.tree import PyTree


def init_params(cfg: ModelConfig, mesh: Optional[DeviceMesh], seed: int = 0, dtype: torch.dtype = torch.float32,
                rules: Rules = DEFAULT_RULES) -> PyTree:
    """``model.init(cfg, seed)``, as DTensors placed by ``rules`` when ``mesh`` is given (equal to
    sharding the full tree; no rank holds more than one full leaf at once)."""
    if mesh is None:
        return model.init(cfg, seed=seed, dtype=dtype)
    return init_sharded(gpt.param_specs(cfg), lambda path, spec: gpt.init_leaf(spec, path, cfg, seed, dtype), mesh, rules)


def place_params(params: PyTree, cfg: ModelConfig, mesh: Optional[DeviceMesh], rules: Rules = DEFAULT_RULES) -> PyTree:
    """Full ``params`` of ``cfg`` placed on ``mesh`` by ``rules`` (unchanged without a mesh)."""
    return shard_params(params, model.param_axes(cfg), mesh, rules) if mesh is not None else params
