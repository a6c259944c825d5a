"""One multi-rank parity run, launched by tests/test_parallel.py with torchrun.

Usage: torchrun --nproc-per-node N tests/parallel_worker.py LAYOUT OUT.json [--compile] [--sp] [--mtp] [--fp16]
[--moe] [--mla] [--capacity] [--data-seed=N] [--microbatches=N] (or several such cases, each after ``--case``:
``tests.worker_cases``).
LAYOUT is e.g. ``dp_shard=2`` or ``dp_shard=2,tp=2`` (``ParallelConfig`` fields: ``dp_shard=2,ep=2``
splits the experts over 2 of the 2 data-parallel shard ranks). Trains the tiny model (with one MTP depth
and fp32) for ``STEPS`` (3) steps on the mesh and, in the same process, on plain tensors; rank 0 writes the
per-step losses, the initial and final parameter errors (per-leaf relative L2), graph counts and,
compiled, the collectives one more step issues. ``--fp16`` computes in fp16 with dynamic loss
scaling on both sides. ``--moe`` makes the second layer an MoE layer (``MOE_SETTINGS``: sigmoid
routing with the expert bias, a shared expert, router losses), ``--capacity`` gives its experts a
capacity that drops nothing (the static-shape dispatch), ``--mla`` the attention MLA.
``--data-seed=N`` draws the batches from seeds N, N + 1, ... (default 0); ``--microbatches=N``
splits each global batch into N microbatches of 4 sequences (default 2).
"""

import dataclasses
import json

import torch
import torch._dynamo.utils
import torch.distributed as dist

from experiments.bench.comm import step_collectives
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import adamw
from lmfunc.config.parallel import ParallelConfig
from lmfunc.parallel.mesh import build_mesh, data_parallel_rank, launched_world_size
from lmfunc.parallel.sharding import full_tensors, local_batch_to_dtensor
from lmfunc.precision import LossScaleConfig
from lmfunc.train.params import init_params
from lmfunc.train import TrainState, make_train_step
from lmfunc.tree import flatten_with_paths
from tests.helpers import MLA_SETTINGS, MOE_SETTINGS, lm_batch
from tests.worker_cases import run_worker_cases

STEPS = 3
"""Steps of every run: the first Adam update and two that build on its moments (the bounds in
tests/test_parallel.py were measured over five)."""


def relative_errors(a, b) -> float:
    """The largest per-leaf relative L2 error of ``a`` against ``b``."""
    worst = 0.0
    for (name, x), (_, y) in zip(flatten_with_paths(a), flatten_with_paths(b)):
        worst = max(worst, float((x - y).norm() / y.norm().clamp(min=1e-12)))
    return worst


def total_error(a, b) -> float:
    """The relative L2 error of all of ``a``'s leaves together against ``b``'s."""
    flat = [torch.cat([t.reshape(-1).double() for _, t in flatten_with_paths(tree)]) for tree in (a, b)]
    return float((flat[0] - flat[1]).norm() / flat[1].norm())


@dataclasses.dataclass
class WorkerRun:
    """What a worker command line asks for: the layout, the model, the optimizer, the precision
    settings of ``make_train_step`` and the ``STEPS`` global batches."""

    fields: dict
    cfg: object
    tx: object
    precision: dict
    batches: list

    def local_batch(self, batch: dict, layout) -> dict:
        """This rank's slice of a global batch, as DTensors on the layout's mesh."""
        dp, rank = layout.data_parallel_size, data_parallel_rank(layout)
        per = batch["tokens"].shape[1] // dp
        local = {k: v[:, rank * per:(rank + 1) * per].contiguous() for k, v in batch.items()}
        return local_batch_to_dtensor(local, layout.mesh)


def worker_run(argv: list[str]) -> WorkerRun:
    """The run ``argv`` (this script's arguments: LAYOUT OUT.json [flags]) describes."""
    fields = {k: int(v) for k, v in (item.split("=") for item in argv[0].split(","))}
    cfg = dataclasses.replace(model_preset("tiny"), mtp_num_layers=int("--mtp" in argv), sequence_parallel="--sp" in argv,
                              **(MOE_SETTINGS if "--moe" in argv else {}),
                              **({"moe_expert_capacity_factor": 4.0} if "--capacity" in argv else {}),
                              **(MLA_SETTINGS if "--mla" in argv else {}))
    fp16 = "--fp16" in argv
    precision = {"compute_dtype": torch.float16, "loss_scale": LossScaleConfig(initial_scale=2.0**15)} if fp16 else {}
    first_seed = next((int(a.split("=")[1]) for a in argv if a.startswith("--data-seed=")), 0)
    microbatches = next((int(a.split("=")[1]) for a in argv if a.startswith("--microbatches=")), 2)
    batches = [lm_batch(cfg.vocab_size, microbatches=microbatches, batch=4, seq=16, seed=first_seed + i)
               for i in range(STEPS)]
    return WorkerRun(fields, cfg, adamw(1e-3, weight_decay=0.1), precision, batches)


def run_case(argv: list[str]) -> str:
    """One case (LAYOUT OUT.json [flags]) on the launch's process group: rank 0 writes OUT.json."""
    run = worker_run(argv)
    out_path, compiled = argv[1], "--compile" in argv
    layout = build_mesh(ParallelConfig(**run.fields).sizes(launched_world_size()))
    cfg, tx, precision, batches = run.cfg, run.tx, run.precision, run.batches
    scaling = precision.get("loss_scale")

    reference = TrainState.create(model.init(cfg, seed=0), tx, loss_scale=scaling)
    reference_step = make_train_step(cfg, tx, compile=False, **precision)
    reference_losses, reference_norms = [], []
    for batch in batches:
        reference, metrics = reference_step(reference, batch)
        reference_losses.append(float(metrics["loss"]))
        reference_norms.append(float(metrics["grad_norm"]))

    params = init_params(cfg, layout.mesh, seed=0)
    init_error = relative_errors(full_tensors(params), model.init(cfg, seed=0))
    step = make_train_step(cfg, tx, compile=compiled, **precision)  # Inductor with lmfunc's passes, bucketing included
    state = TrainState.create(params, tx, loss_scale=scaling)
    torch._dynamo.utils.counters.clear()
    losses, grad_norms = [], []
    for batch in batches:
        state, metrics = step(state, run.local_batch(batch, layout))
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    one_step = lambda: step(state, run.local_batch(batches[-1], layout))  # noqa: E731
    collectives, elements = step_collectives(one_step) if compiled else (None, None)
    final = full_tensors(state.params)
    final_error = relative_errors(final, reference.params)
    moments = full_tensors(state.opt_state[0].mu)
    leaf_placements = {path: str(tuple(p.placements)) for path, p in flatten_with_paths(state.params)}
    placements = sorted(set(leaf_placements.values()))
    cache_hits = [None] * dist.get_world_size()  # Inductor graphs each rank found in its compile cache
    dist.all_gather_object(cache_hits, int(torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({
                "losses": losses, "reference_losses": reference_losses, "init_error": init_error,
                "grad_norms": grad_norms, "reference_grad_norms": reference_norms,
                "final_error": final_error, "moment_error": relative_errors(moments, reference.opt_state[0].mu),
                "total_final_error": total_error(final, reference.params),
                "total_moment_error": total_error(moments, reference.opt_state[0].mu),
                "frames": torch._dynamo.utils.counters["stats"]["unique_graphs"], "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                "placements": placements, "leaf_placements": leaf_placements, "collectives": collectives, "elements": elements,
                "cache_hits": cache_hits,
            }, f)
    dist.barrier()
    return f"{len(losses)} steps, largest leaf error {final_error:.1e}"


if __name__ == "__main__":
    run_worker_cases(run_case)
