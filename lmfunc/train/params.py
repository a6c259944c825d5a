"""A run's initial parameters: ``model.init`` on one process, made straight into shards on a mesh
(``parallel.sharding.init_sharded`` over the model's leaf specs)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from lmfunc import model
from lmfunc.config import ModelConfig
from lmfunc.config.train import TrainConfig
from lmfunc.model import gpt
from lmfunc.parallel.mesh import Layout
from lmfunc.parallel.sharding import DEFAULT_RULES, Rules, init_sharded, shard_params
from lmfunc.tree import PyTree, tree_map


def init_params(cfg: ModelConfig, mesh: Optional[DeviceMesh], seed: int = 0, dtype: torch.dtype = torch.float32,
                rules: Rules = DEFAULT_RULES, device: str | torch.device = "cpu") -> PyTree:
    """``model.init(cfg, seed)`` on ``device``, or as DTensors placed by ``rules`` on ``mesh`` (its
    device; equal to sharding the full tree; no rank holds more than one full leaf at once). The
    values do not depend on the device: each leaf is drawn on the CPU from its own generator."""
    if mesh is None:
        return tree_map(lambda leaf: leaf.to(device), model.init(cfg, seed=seed, dtype=dtype))
    return init_sharded(gpt.param_specs(cfg), lambda path, spec: gpt.init_leaf(spec, path, cfg, seed, dtype), mesh, rules)


def place_params(params: PyTree, cfg: ModelConfig, mesh: Optional[DeviceMesh], rules: Rules = DEFAULT_RULES,
                 device: str | torch.device = "cpu") -> PyTree:
    """Full ``params`` of ``cfg`` placed on ``mesh`` by ``rules`` (moved to ``device`` without a mesh)."""
    if mesh is None:
        return tree_map(lambda leaf: leaf.to(device), params)
    return shard_params(params, model.param_axes(cfg), mesh, rules)


def imported_params(cfg: TrainConfig) -> Optional[PyTree]:
    """The full parameters ``checkpoint.load_hf`` or ``checkpoint.load_megatron`` names (fp32,
    on the CPU), or None when the run starts from neither."""
    if cfg.checkpoint.load_hf is not None:
        from lmfunc.checkpoint.hf import load_hf

        return load_hf(cfg.checkpoint.load_hf, cfg.model)
    if cfg.checkpoint.load_megatron is not None:
        from lmfunc.checkpoint.megatron import load_megatron

        return load_megatron(cfg.checkpoint.load_megatron, cfg.model).params
    return None


def initial_params(cfg: TrainConfig, layout: Layout, resuming: bool) -> PyTree:
    """Freshly initialised parameters, or those imported from ``checkpoint.load_hf`` or
    ``checkpoint.load_megatron`` (unless the run resumes from its own checkpoint), in the layout."""
    imported = None if resuming else imported_params(cfg)
    if imported is not None:
        return place_params(imported, cfg.model, layout.mesh, device=layout.device)
    return init_params(cfg.model, layout.mesh, seed=cfg.run.seed, device=layout.device)
