"""What the trainer needs to run a pipeline-parallel layout: this process's pipeline rank and split,
its part of the initial parameters, and the whole tree gathered back for the final weights and the
sample.

Every process is one pipeline rank, and its state is its part of the parameter tree
(``rank_params``, under the model-wide names). With ``pp`` alone those leaves are plain tensors;
with data- or tensor-parallel dims beside ``pp`` they are DTensors on those dims (``data_mesh``),
sharded by the same rules as without a pipeline. A checkpoint holds every rank's leaves under the
model-wide names, so it loads on any other layout, or on one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lmfunc.config.model import ModelConfig
from lmfunc.config.pipeline import PipelineSplit
from lmfunc.config.train import TrainConfig
from lmfunc.model import gpt
from lmfunc.parallel.mesh import Layout
from lmfunc.parallel.sharding import full_tensors, init_sharded, shard_params
from lmfunc.model.stages import rank_params
from lmfunc.train.params import imported_params
from lmfunc.train.pipeline_step import make_pipeline_eval_step, make_pipeline_train_step
from lmfunc.tree import PyTree, flatten_with_paths, tree_map, tree_map_with_path, tree_unflatten_as


@dataclass(frozen=True)
class PipelineRank:
    """This process's place in the pipeline: the split, the schedule, the pipeline process group
    and its rank in it, the run's mesh (with its ``pp`` dim) and the data- and tensor-parallel
    mesh beside ``pp`` that this rank's leaves live on (None with ``pp`` alone)."""

    split: PipelineSplit
    schedule: str
    group: dist.ProcessGroup
    rank: int
    mesh: DeviceMesh
    data_mesh: Optional[DeviceMesh]


def pipeline_rank(cfg: TrainConfig, layout: Layout) -> Optional[PipelineRank]:
    """The pipeline rank of this process under ``layout`` (None when ``pp`` is 1)."""
    if layout.sizes["pp"] == 1:
        return None
    p = cfg.parallel
    split = p.pipeline_split(cfg.model.num_layers)
    others = tuple(name for name in layout.dims() if name != "pp")
    return PipelineRank(split, p.pp_schedule, layout.mesh.get_group("pp"), layout.mesh.get_local_rank("pp"),
                        layout.mesh, layout.mesh[others] if others else None)


def _is_spec(x) -> bool:
    return hasattr(x, "axes") and not isinstance(x, dict)


def init_rank_params(cfg: ModelConfig, pipe: PipelineRank, seed: int, device: torch.device) -> PyTree:
    """This rank's part of ``model.init(cfg, seed)`` on ``device``, drawing only its own leaves
    (each leaf has its own generator, so the values equal the whole tree's), sharded on
    ``pipe.data_mesh`` when there is one."""
    specs = rank_params(gpt.param_specs(cfg), cfg, pipe.split, pipe.rank)

    def make(path: str, spec) -> torch.Tensor:
        return gpt.init_leaf(spec, path, cfg, seed, torch.float32).to(device)

    if pipe.data_mesh is not None:
        return init_sharded(specs, make, pipe.data_mesh)
    return tree_map_with_path(make, specs, is_leaf=_is_spec)


def initial_rank_params(cfg: TrainConfig, pipe: PipelineRank, device: torch.device, resuming: bool) -> PyTree:
    """This rank's part of the run's initial parameters: imported from ``checkpoint.load_hf`` or
    ``checkpoint.load_megatron`` (unless the run resumes from its own checkpoint; every rank reads
    the files and keeps its leaves), else freshly drawn (``init_rank_params``)."""
    imported = None if resuming else imported_params(cfg)
    if imported is not None:
        part = rank_params(imported, cfg.model, pipe.split, pipe.rank)
        part = tree_map(lambda leaf: leaf.to(device), part)
        if pipe.data_mesh is not None:
            axes = rank_params(gpt.param_axes(cfg.model), cfg.model, pipe.split, pipe.rank)
            return shard_params(part, axes, pipe.data_mesh)
        return part
    return init_rank_params(cfg.model, pipe, cfg.run.seed, device)


def gather_pipeline_params(params: PyTree, cfg: ModelConfig, pipe: PipelineRank, device: torch.device) -> PyTree:
    """The whole parameter tree on every rank, from each rank's part ``params`` (a collective: each
    leaf is broadcast from the lowest pipeline rank that holds it; DTensor leaves are gathered
    first)."""
    whole = gpt.param_shapes(cfg)
    mine = dict(flatten_with_paths(full_tensors(params)))
    owners: dict[str, int] = {}
    for rank in reversed(range(pipe.split.pp)):
        for path, _ in flatten_with_paths(rank_params(whole, cfg, pipe.split, rank)):
            owners[path] = rank
    leaves = []
    for path, shape in flatten_with_paths(whole):
        owner = owners[path]
        leaf = mine[path].detach().clone() if owner == pipe.rank else torch.empty(shape.shape, dtype=shape.dtype,
                                                                                  device=device)
        dist.broadcast(leaf, src=dist.get_global_rank(pipe.group, owner), group=pipe.group)
        leaves.append(leaf)
    return tree_unflatten_as(whole, leaves)


def pipeline_steps(cfg: TrainConfig, pipe: PipelineRank, microbatches: int, tx, lr_schedule, loss_scale,
                   compute_dtype: torch.dtype, device: torch.device,
                   backend_for: Optional[Callable] = None) -> tuple[Callable, Callable, str]:
    """The pipeline rank's train and eval steps (``lmfunc.train.pipeline_step``): torch's schedule
    over this rank's stages for ``microbatches`` per step, every rank loading its data-parallel
    part of the batch; and the line that describes them. ``backend_for``: the train step's compile
    backends (``make_pipeline_train_step``; the dry run's)."""
    compile = cfg.run.compile
    train_step = make_pipeline_train_step(
        cfg.model, tx, pipe.split, pipe.schedule, microbatches, clip_grad=cfg.optim.clip_grad,
        lr_schedule=lr_schedule, compute_dtype=compute_dtype, loss_scale=loss_scale, device=device, compile=compile,
        mesh=pipe.mesh, donate_state=True, backend_for=backend_for)
    eval_step = make_pipeline_eval_step(cfg.model, pipe.split, pipe.schedule, microbatches,
                                        compute_dtype=compute_dtype, device=device, compile=compile, mesh=pipe.mesh)
    description = (f"pipeline: {pipe.schedule} over pp {pipe.split.pp} ({pipe.split.num_stages} stages, "
                   f"{microbatches} microbatches per step); rank 0 runs "
                   + ", ".join(f"stage {s}: layers {list(pipe.split.layers[s])}" for s in pipe.split.stages_of_rank(0))
                   + ("; each stage's forward and backward and the update compiled" if compile else "; eager"))
    return train_step, eval_step, description
