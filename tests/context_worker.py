"""Worker for tests/test_context_parallel.py (launched by torchrun, gloo): every rank trains the same
tiny model two ways, the one-process eager ``make_train_step`` on the whole batch and the same step
over DTensors on a ``dp_shard x cp x tp`` mesh, whose batch is each sequence in load-balanced order
split over ``cp`` (``local_batch_to_dtensor``). It checks the first microbatch's gradients (rel L2
1e-6 per leaf), the metrics at every step, and the final params and Adam moments.

``python -m tests.context_worker DP_SHARD CP TP SP MTP DOCS [COMPILE [RECOMPUTE]] [--moe] [--mla] [--ep=N]`` (or
several such cases, each after ``--case``: ``tests.worker_cases``):
mesh sizes (world = their product), SP 0/1 sequence parallelism over tp, MTP the number of MTP
depths, DOCS 0/1 documents packed into each sequence (position ids restarting after each EOD, a
document-masked attention and EOD-masked loss), COMPILE 0/1 the step compiled, RECOMPUTE the
split run's ``recompute_granularity`` (none, selective or full; the reference recomputes nothing).
``--moe`` and ``--mla`` (``tests.helpers.model_flags``) make the second layer (and the MTP layer)
an MoE layer and the attention MLA; ``--ep=N`` splits the experts over N of the DP_SHARD ranks. No
dropout: its masks follow the element index, which a load-balanced sequence permutes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import implicit_replication

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.data.batch import lm_batch
from lmfunc.grad import value_and_grad
from lmfunc.loss import lm_loss
from lmfunc.optim import adamw
from lmfunc.parallel.mesh import use_compile_cache_for
from lmfunc.parallel.sharding import full_tensors, local_batch_to_dtensor, shard_params
from lmfunc.train import TrainState, make_train_step
from lmfunc.tree import flatten_with_paths
from tests.helpers import model_flags
from tests.worker_cases import run_worker_cases

STEPS, MICROBATCHES, ROWS, SEQ, EOD = 3, 2, 4, 32, 0
"""Three steps, as ``tests/pipeline_worker.py``; the bounds below were measured over five."""
TOLERANCE = {"gradients": 1e-6, "metrics": 1e-5, "leaves": 1e-5}
MTP_LEAVES_TOLERANCE = 1e-4
"""With MTP, five Adam steps turn rounding-level gradient differences into parameter differences of
2e-5 to 9e-5 in the second layer's attention, on this layout and on plain dp_shard 2 alike
(measured; the gradients of the first step agree to 3e-7): the trajectory is sensitive there, so the
MTP cases check the leaves to 1e-4 and lean on the gradient check."""
MOE_LEAVES_TOLERANCE = 2e-5
"""With an MoE layer, as ``tests/test_parallel.py``'s MoE bounds: the params and moments as a whole
to 1e-5 (the issue's measure, checked for every run) and any one leaf to 2e-5; a top-k choice near
a tie amplifies rounding-level differences. Measured on cp 2 x tp 2 with SP, MoE and MLA: a dense
MLP leaf 1.0e-5 (MLA alone 7e-6, MoE alone 3e-6) after five steps, all leaves together 8.8e-7, and
the first microbatch's gradients within the 1e-6 per leaf checked first."""
COMPILED_LEAVES_TOLERANCE = 2e-4
"""As ``tests/pipeline_worker.py``: Inductor's kernels round differently from the eager reference,
and Adam turns that into parameter differences of up to about 1e-4 in five steps."""


def batch_of(step: int, vocab: int, docs: bool) -> dict:
    """A ``[M, B, S]`` batch of random tokens; with ``docs`` each row packs several documents."""
    g = torch.Generator().manual_seed(step)
    samples = torch.randint(1, vocab, (MICROBATCHES, ROWS, SEQ + 1), generator=g)
    if docs:
        samples[torch.rand(samples.shape, generator=g) < 0.08] = EOD
    return lm_batch(samples, EOD, reset_position_ids=docs, reset_attention_mask=docs, eod_mask_loss=docs)


def check_gradients(params, sharded, batch: dict, cfg, mesh, dp_rank: int, dp: int) -> None:
    """The summed gradients of the first microbatch's token losses, one process against the mesh."""

    def objective(p, micro):
        out = lm_loss(p, micro, cfg, None, torch.tensor(1.0) if cfg.mtp_num_layers else None)
        return out.loss_sum

    rows = ROWS // dp
    local = {k: v[:1, dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}
    expected = dict(flatten_with_paths(value_and_grad(objective)(params, {k: v[0] for k, v in batch.items()})[1]))
    with implicit_replication():
        _, grads = value_and_grad(objective)(sharded, {k: v[0] for k, v in local_batch_to_dtensor(local, mesh).items()})
    errors = {path: rel_l2(g, expected[path]) for path, g in flatten_with_paths(full_tensors(grads))}
    path, error = max(errors.items(), key=lambda item: item[1])
    assert error < TOLERANCE["gradients"], f"rank {dist.get_rank()}: the gradient of {path} differs by rel L2 {error:.2e}"


def total_error(a, b) -> float:
    """The relative L2 error of all of ``a``'s floating-point leaves together against ``b``'s."""
    flat = [torch.cat([t.reshape(-1).double() for _, t in flatten_with_paths(tree) if t.is_floating_point()])
            for tree in (a, b)]
    return float((flat[0] - flat[1]).norm() / flat[1].norm())


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_case(argv: list[str]) -> str:
    """One case (the module docstring's arguments) on the launch's process group; what it measured."""
    flags = [a for a in argv if a.startswith("--")]
    args = [a for a in argv if not a.startswith("--")]
    dp, cp, tp, sp, mtp, docs = (int(a) for a in args[:6])
    compiled = len(args) > 6 and bool(int(args[6]))
    recompute = args[7] if len(args) > 7 else "none"
    ep = next((int(a.split("=")[1]) for a in flags if a.startswith("--ep=")), 1)
    sizes = {name: size for name, size in (("dp_shard", dp // ep), ("ep", ep), ("cp", cp), ("tp", tp)) if size > 1}
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    use_compile_cache_for(mesh)  # each rank of a 2-D mesh its own compiled graphs
    dp_rank = ((mesh.get_local_rank("dp_shard") if dp > ep else 0) * ep
               + (mesh.get_local_rank("ep") if ep > 1 else 0))
    cfg = dataclasses.replace(model_preset("tiny", num_layers=2), mtp_num_layers=mtp, sequence_parallel=bool(sp),
                              scan_layers=False, **model_flags(flags))
    params = model.init(cfg, seed=0)
    tx = adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    reference = make_train_step(cfg, tx, compile=False)
    split = make_train_step(dataclasses.replace(cfg, recompute_granularity=recompute), tx, compile=compiled)
    whole = TrainState.create(params, tx)
    mine = TrainState.create(shard_params(params, model.param_axes(cfg), mesh), tx)
    if ep > 1:
        experts = mine.params["layers"]["1"]["mlp"]["experts"]["w_gate"]
        assert experts.placements[list(sizes).index("ep")] == Shard(0), experts.placements
    check_gradients(params, mine.params, batch_of(0, cfg.vocab_size, bool(docs)), cfg, mesh, dp_rank, dp)
    worst = 0.0
    for step in range(STEPS):
        batch = batch_of(step, cfg.vocab_size, bool(docs))
        rows = ROWS // dp
        local = {k: v[:, dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}
        whole, expected = reference(whole, batch)
        mine, got = split(mine, local_batch_to_dtensor(local, mesh))
        for key, value in expected.items():
            got_value = got[key].full_tensor() if hasattr(got[key], "full_tensor") else got[key]
            difference = float((torch.as_tensor(got_value) - value).abs().max())
            worst = max(worst, difference / max(float(torch.as_tensor(value).abs().max()), 1e-12))
    rank = dist.get_rank()
    assert worst < TOLERANCE["metrics"], f"rank {rank}: metrics differ by rel {worst:.2e}"
    reference_leaves = dict(flatten_with_paths((whole.params, whole.opt_state)))
    errors = {path: rel_l2(leaf, reference_leaves[path])
              for path, leaf in flatten_with_paths(full_tensors((mine.params, mine.opt_state)))
              if leaf.is_floating_point() and leaf.dim() > 0}
    path, error = max(errors.items(), key=lambda item: item[1])
    bound = max(COMPILED_LEAVES_TOLERANCE if compiled else TOLERANCE["leaves"], MTP_LEAVES_TOLERANCE if mtp else 0.0,
                MOE_LEAVES_TOLERANCE if cfg.num_experts else 0.0)
    assert error < bound, f"rank {rank}: {path} differs by rel L2 {error:.2e}"
    total = total_error(full_tensors((mine.params, mine.opt_state)), (whole.params, whole.opt_state))
    assert total < TOLERANCE["leaves"], f"rank {rank}: the params and moments differ by rel L2 {total:.2e} in all"
    return f"{len(errors)} leaves, worst metric rel {worst:.1e}, worst leaf {path} {error:.1e}, all leaves {total:.1e}"


if __name__ == "__main__":
    run_worker_cases(run_case)
