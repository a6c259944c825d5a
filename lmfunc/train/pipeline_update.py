"""The update of a pipeline-parallel rank's train step (``lmfunc.train.pipeline_step``): the same
update as ``make_train_step``'s, with the gradient norm, the overflow flag and the metrics reduced
over the pipeline group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmfunc.compiler.torch_compat.tensors import foreach_div
from lmfunc.model import moe
from lmfunc.optim import apply_updates, clip_by_global_norm_with_norm, global_norm
from lmfunc.precision import all_finite
from lmfunc.train.pipeline_stages import unpacked_router
from lmfunc.train.step import skip_on_overflow, write_into
from lmfunc.tree import flatten_with_paths, tree_unflatten_as


def _full(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's value as a plain tensor (reduced or gathered over its mesh); plain tensors unchanged."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def pipeline_update(state, grads, sums, tx, clip_grad, loss_scale, group, lr_schedule, cfg, normaliser, num_tokens, counted,
            consumed, donate, num_micro, held_moe_layers):
    """``make_train_step``'s update of this rank's state, with the norm and overflow flag reduced
    over the pipeline and the metrics (``sums``: this rank's summed main and MTP token losses and
    MTP token counts, then with MoE layers ``router_sums``) summed from the stages to every rank;
    with MoE layers every expert bias this rank holds (``held_moe_layers``) moved by its layer's
    load; with ``donate`` written into the input state's tensors."""
    scale = state.loss_scale.scale if loss_scale is not None else None
    paths = [path for path, _ in flatten_with_paths(grads)]
    leaves = [leaf for _, leaf in flatten_with_paths(grads)]
    found_inf = None
    if scale is not None:
        leaves = foreach_div(leaves, scale)
        overflow = (~all_finite(leaves)).to(torch.float32)
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
        found_inf = overflow > 0
    device = leaves[0].device
    mine = [leaf for path, leaf in zip(paths, leaves) if counted(path)]
    norm_sq = _full(global_norm(mine)) ** 2 if mine else torch.zeros((), device=device)
    dist.all_reduce(norm_sq, group=group)
    grad_norm = norm_sq.sqrt()
    grads = tree_unflatten_as(state.params, leaves)
    if clip_grad > 0:
        grads, _ = clip_by_global_norm_with_norm(grads, clip_grad, norm=grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = apply_updates(state.params, updates)
    depths = cfg.mtp_num_layers
    sums = sums.clone()
    dist.all_reduce(sums, group=group)
    metrics = {"loss": sums[0] * normaliser, "grad_norm": grad_norm, "num_tokens": num_tokens}
    for k in range(depths):
        metrics[f"mtp_{k + 1}_loss"] = sums[1 + k] / torch.clamp(sums[1 + depths + k], min=1.0)
    params, opt_state, new_loss_scale, optimizer_steps = skip_on_overflow(state, params, opt_state, found_inf,
                                                                          loss_scale, metrics)
    if moe.moe_layer_names(cfg):
        router = unpacked_router(sums[1 + 2 * depths:], cfg.num_experts)
        params = moe.updated_expert_biases(params, router.load[held_moe_layers], cfg,
                                           [moe.moe_layer_names(cfg)[i] for i in held_moe_layers])
        metrics |= moe.router_metrics(router, num_micro, cfg)
    if lr_schedule is not None:
        metrics["lr"] = lr_schedule(optimizer_steps)
    if donate:
        params, opt_state = write_into(state.params, params), write_into(state.opt_state, opt_state)
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                              consumed_samples=state.consumed_samples + consumed, loss_scale=new_loss_scale)
    return new_state, metrics
