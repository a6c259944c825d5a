"""Load one checkpoint step into a mesh layout and write the gathered state (rank 0) to a .pt file.

    torchrun --standalone --nproc-per-node N tests/checkpoint_worker.py STEP_DIR LAYOUT OUT.pt
    LAYOUT: "single" or comma-separated mesh sizes, e.g. "tp=2" or "dp_shard=2,tp=2"; with "pp=N"
    (possibly beside other sizes, "pp=2,tp=2") each pipeline rank loads its part and the parts are
    gathered.
"""

import sys

import torch
import torch.distributed as dist

from lmfunc.checkpoint.sharded import load_tree
from lmfunc.config.train import ParallelConfig
from lmfunc.parallel.mesh import build_mesh, launched_world_size
from lmfunc.parallel.sharding import full_tensors
from lmfunc.train.params import init_params
from lmfunc.train.pipeline_run import init_rank_params, pipeline_rank
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.checkpoint.locate import saved_config
from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
from lmfunc.train.state import TrainState
from lmfunc.tree import flatten_with_paths
from lmfunc.train.__main__ import exit_without_finalizing


def main(step_dir: str, layout: str, out: str) -> None:
    sizes = {} if layout == "single" else {k: int(v) for k, v in (item.split("=") for item in layout.split(","))}
    cfg = saved_config(step_dir)
    cfg = cfg.replace(parallel=ParallelConfig(**sizes))
    mesh_layout = build_mesh(cfg.parallel.sizes(launched_world_size()))
    pipe = pipeline_rank(cfg, mesh_layout)
    if pipe is not None:
        params = init_rank_params(cfg.model, pipe, seed=1, device=torch.device("cpu"))
    else:
        params = init_params(cfg.model, mesh_layout.mesh, seed=1)
    plan = BatchPlan.from_config(cfg.run, mesh_layout.data_parallel_size)
    tx = build_optimizer(cfg, build_lr_schedule(cfg, plan, cfg.run.train_iters), params, None)
    fresh = TrainState.create(params, tx, seed=0, loss_scale=cfg.precision.loss_scaling())
    state = load_tree(fresh, step_dir, allow_unused=pipe is not None)
    if pipe is not None:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, dict(flatten_with_paths(full_tensors(state))))
        full = {path: leaf for part in parts for path, leaf in part.items()}
    else:
        full = dict(flatten_with_paths(full_tensors(state)))
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(full, out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_without_finalizing()
