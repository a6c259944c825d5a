"""One multi-rank parity run, launched by tests/test_parallel.py with torchrun.

Usage: torchrun --nproc-per-node N tests/parallel_worker.py LAYOUT OUT.json [--compile] [--sp] [--mtp] [--fp16]
LAYOUT is e.g. ``dp_shard=2`` or ``dp_shard=2,tp=2``. Trains the tiny model (with one MTP depth
and fp32) for 5 steps on the mesh and, in the same process, on plain tensors; rank 0 writes the
per-step losses, the initial and final parameter errors (per-leaf relative L2), graph counts and,
compiled, the collectives one more step issues. ``--fp16`` computes in fp16 with dynamic loss
scaling on both sides.
"""

import dataclasses
import json
import sys

import torch
import torch._dynamo.utils
import torch.distributed as dist

from experiments.bench.comm import step_collectives
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import adamw
from lmfunc.parallel.mesh import build_mesh, data_parallel_rank
from lmfunc.parallel.sharding import full_tensors, local_batch_to_dtensor
from lmfunc.precision import LossScaleConfig
from lmfunc.train.params import init_params
from lmfunc.train import TrainState, make_train_step
from lmfunc.tree import flatten_with_paths
from lmfunc.train.__main__ import exit_without_finalizing
from tests.helpers import lm_batch


def relative_errors(a, b) -> float:
    worst = 0.0
    for (name, x), (_, y) in zip(flatten_with_paths(a), flatten_with_paths(b)):
        worst = max(worst, float((x - y).norm() / y.norm().clamp(min=1e-12)))
    return worst


def main() -> None:
    sizes = {k: int(v) for k, v in (item.split("=") for item in sys.argv[1].split(","))}
    out_path, compiled, sp = sys.argv[2], "--compile" in sys.argv, "--sp" in sys.argv
    layout = build_mesh(sizes)
    cfg = dataclasses.replace(model_preset("tiny"), mtp_num_layers=int("--mtp" in sys.argv), sequence_parallel=sp)
    tx = adamw(1e-3, weight_decay=0.1)
    fp16 = "--fp16" in sys.argv
    precision = {"compute_dtype": torch.float16, "loss_scale": LossScaleConfig(initial_scale=2.0**15)} if fp16 else {}
    scaling = precision.get("loss_scale")
    batches = [lm_batch(cfg.vocab_size, microbatches=2, batch=4, seq=16, seed=i) for i in range(5)]

    reference = TrainState.create(model.init(cfg, seed=0), tx, loss_scale=scaling)
    reference_step = make_train_step(cfg, tx, compile=False, **precision)
    reference_losses = []
    for batch in batches:
        reference, metrics = reference_step(reference, batch)
        reference_losses.append(float(metrics["loss"]))

    params = init_params(cfg, layout.mesh, seed=0)
    init_error = relative_errors(full_tensors(params), model.init(cfg, seed=0))
    step = make_train_step(cfg, tx, compile=compiled, **precision)  # Inductor with lmfunc's passes, bucketing included
    state = TrainState.create(params, tx, loss_scale=scaling)
    dp, rank = layout.data_parallel_size, data_parallel_rank(layout)
    torch._dynamo.utils.counters.clear()
    losses = []
    for batch in batches:
        per = batch["tokens"].shape[1] // dp
        local = {k: v[:, rank * per:(rank + 1) * per].contiguous() for k, v in batch.items()}
        state, metrics = step(state, local_batch_to_dtensor(local, layout.mesh))
        losses.append(float(metrics["loss"]))
    one_step = lambda: step(state, local_batch_to_dtensor(local, layout.mesh))  # noqa: E731
    collectives, elements = step_collectives(one_step) if compiled else (None, None)
    final_error = relative_errors(full_tensors(state.params), reference.params)
    moments = full_tensors(state.opt_state[0].mu)
    placements = sorted({str(tuple(p.placements)) for _, p in flatten_with_paths(state.params)})
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({
                "losses": losses, "reference_losses": reference_losses, "init_error": init_error,
                "final_error": final_error, "moment_error": relative_errors(moments, reference.opt_state[0].mu),
                "frames": torch._dynamo.utils.counters["stats"]["unique_graphs"], "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                "placements": placements, "collectives": collectives, "elements": elements,
            }, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
