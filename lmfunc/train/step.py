"""The training step as one function: ``step(state, batch) -> (state, metrics)``.

Inside: a loop over microbatches (each differentiates its share of the normalised, loss-scaled
objective, so gradients just add up in fp32), unscaling and the finite check, global-norm
clipping, the optimizer update (skipped on overflow), the loss-scaler update and the counters.
Multi-token prediction and the MoE routers add their losses through ``attach_aux_loss`` inside
``lm_loss``; the routers' expert biases are state updated without a gradient. With
``compile=True`` the whole step is one ``torch.compile(fullgraph=True)`` graph.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Optional, Union

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from lmfunc.compiler.torch_compat.tensors import foreach_add, foreach_div, is_fake
from lmfunc.config import ModelConfig
from lmfunc.compiler.accumulation_order import mark_accumulation, mark_microbatch
from lmfunc.grad import value_and_grad
from lmfunc.model import moe
from lmfunc.loss import LossOutput, lm_loss
from lmfunc.optim import GradientTransformation, apply_updates, clip_by_global_norm_with_norm, global_norm
from lmfunc.optim.transforms import Schedule
from lmfunc.precision import LossScaleConfig, all_finite, cast_params, select_tree, update_loss_scale
from lmfunc.compiler import compile_step, precompiled_step
from lmfunc.compiler.collective_buckets import DEFAULT_BUCKET_MB
from lmfunc.train.state import TrainState
from lmfunc.parallel.sharding import match_placements
from lmfunc.tree import PyTree, flatten_with_paths, tree_leaves, tree_map, tree_unflatten_as

Batch = Mapping[str, torch.Tensor]
Metrics = dict[str, torch.Tensor]
LossFn = Callable[..., LossOutput]

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "doc_ids")


def check_batch(batch: Batch) -> None:
    """Raise a clear error unless ``batch`` holds ``[microbatches, B, S]`` tensors with known keys."""
    for key in ("tokens", "labels"):
        if key not in batch:
            raise KeyError(f"batch is missing {key!r}; a batch needs tokens and labels of shape [microbatches, B, S]")
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise KeyError(f"batch has unknown keys {unknown}; expected a subset of {list(BATCH_KEYS)}")
    shape = tuple(batch["tokens"].shape)
    if len(shape) != 3:
        raise ValueError(f"batch['tokens'] must be [microbatches, B, S], got shape {shape}")
    for key, value in batch.items():
        if tuple(value.shape) != shape:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)} but batch['tokens'] has {shape}")


def microbatch_seed(state: TrainState, index: int) -> torch.Tensor:
    """The dropout seed of microbatch ``index`` of this step: a pure function of the run's seed,
    the step and the index, so every layout (and a pipeline stage) draws the same masks."""
    return state.rng * 1_000_003 + state.step * 4096 + index


def distributed_context(params) -> contextlib.AbstractContextManager:
    """With DTensor parameters, plain tensors made inside the step (RoPE tables, masks, constants)
    count as replicated on the mesh (``implicit_replication``); otherwise nothing."""
    if any(isinstance(leaf, DTensor) for leaf in tree_leaves(params)):
        return implicit_replication()
    return contextlib.nullcontext()


def full_metrics(metrics: Metrics) -> Metrics:
    """Metrics as plain tensors, equal on every rank (DTensor values reduced or gathered)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()}


def _callable_step(
    fn: Callable, compile: bool, backend: Union[str, Callable], before: Optional[Callable] = None,
    precompile: bool = False, bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB,
) -> Callable:
    """The one wrapper a step call passes through: ``before(first_arg)`` (a check, when given),
    then ``fn`` (``compile_step`` when asked, ``precompiled_step`` when also ``precompile`` and the
    backend is Inductor) inside ``distributed_context`` of the first argument's params, entered
    outside the compiled region: Dynamo cannot trace it."""
    if compile and precompile and backend == "inductor":
        inner = precompiled_step(fn)
    else:
        inner = compile_step(fn, backend, bucket_size_mb=bucket_size_mb) if compile else fn

    def step(state_or_params, batch):
        if before is not None:
            before(state_or_params)
        params = state_or_params.params if isinstance(state_or_params, TrainState) else state_or_params
        with distributed_context(params):
            return inner(state_or_params, batch)

    return step


def make_eval_step(
    cfg: ModelConfig, loss_fn: LossFn = lm_loss, compute_dtype: torch.dtype = torch.float32,
    compile: bool = True, backend: Union[str, Callable] = "inductor", precompile: bool = False,
    bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB,
) -> Callable[..., Metrics]:
    """``eval_step(params, batch) -> {"loss_sum", "num_tokens"}`` over all microbatches, no dropout,
    in ``compute_dtype`` (the main next-token loss only, as Megatron's evaluation); ``compile``,
    ``backend``, ``precompile`` and ``bucket_size_mb`` as for ``make_train_step`` (on a mesh, the
    FSDP gathers are bucketed per region; None leaves them per parameter)."""

    def eval_step(params, batch: Batch) -> Metrics:
        params = cast_params(params, compute_dtype)
        loss_sum = torch.zeros((), dtype=torch.float32, device=batch["tokens"].device)
        num_tokens = torch.zeros((), dtype=torch.float32, device=batch["tokens"].device)
        for i in range(batch["tokens"].shape[0]):
            out = loss_fn(params, {k: v[i] for k, v in batch.items()}, cfg)
            loss_sum, num_tokens = loss_sum + out.loss_sum, num_tokens + out.num_tokens
        return full_metrics({"loss_sum": loss_sum, "num_tokens": num_tokens})

    return _callable_step(eval_step, compile, backend, precompile=precompile, bucket_size_mb=bucket_size_mb)


def evaluate(eval_step, params, batches: list[dict]) -> float:
    """Mean loss per token over ``batches``."""
    loss_sum, count = 0.0, 0.0
    for batch in batches:
        out = eval_step(params, batch)
        loss_sum, count = loss_sum + float(out["loss_sum"]), count + float(out["num_tokens"])
    return loss_sum / max(count, 1.0)


def make_train_step(
    cfg: ModelConfig,
    tx: GradientTransformation,
    *,
    clip_grad: float = 1.0,
    lr_schedule: Optional[Schedule] = None,
    loss_fn: LossFn = lm_loss,
    compute_dtype: torch.dtype = torch.float32,
    loss_scale: Optional[LossScaleConfig] = None,
    calculate_per_token_loss: bool = True,
    compile: bool = True,
    backend: Union[str, Callable] = "inductor",
    donate_state: bool = False,
    precompile: bool = False,
    bucket_size_mb: Optional[float] = DEFAULT_BUCKET_MB,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build ``step(state, batch) -> (state, metrics)``.

    batch: ``tokens``/``labels`` (and optional ``loss_mask``, ``position_ids``, ``doc_ids``) of
        shape ``[M, B, S]`` with M microbatches.
    calculate_per_token_loss: True (default) divides the summed token losses of the whole batch
        once by its token count, whatever M is (Megatron's ``--calculate-per-token-loss``);
        False averages each microbatch's own per-token mean over the M microbatches (Megatron's
        default). The two agree when every microbatch has the same number of loss tokens.
    clip_grad: global-norm clip (Megatron's rule, after unscaling); 0 disables clipping.
    lr_schedule: reported as ``metrics["lr"]`` (the lr this update used) when given.
    loss_fn: ``loss_fn(params, microbatch, cfg, dropout_seed, grad_scale,
        calculate_per_token_loss) -> LossOutput`` (``lmfunc.loss.lm_loss``).
    compute_dtype: forward/backward dtype; params, grads and optimizer state stay fp32.
    loss_scale: loss scaling (static or dynamic); the state needs ``loss_scale`` from
        ``TrainState.create(..., loss_scale=...)``. A step with non-finite gradients leaves the
        params and optimizer state untouched and counts as skipped.
    compile/backend: compile the whole step with ``torch.compile(fullgraph=True)`` and this backend.
    precompile: with Inductor, save the compiled step whole on its first call and load it in a
        restarted process instead of tracing it again (``lmfunc.compiler.precompiled_step``).
    bucket_size_mb: compiled, on a mesh: the largest bucket of the data-parallel gradient
        all-reduces; FSDP's collectives are bucketed per transformer block
        (``lmfunc.compiler.collective_buckets``). None leaves every collective as DTensor issues it.
    donate_state: write the new params and optimizer state into the input state's tensors
        (JAX's ``donate_argnums``) and return a state holding those same tensors (0-dim
        leaves, the update counters, come back as new tensors). Compiled, the
        update then happens in place: the step needs no second copy of params + Adam moments
        (3 x the fp32 parameter bytes), which is its peak when parameters outweigh a
        microbatch's activations. The input state must not be used afterwards, and the donated
        tensors must not share storage (a ``ValueError`` says which do).
    Metrics: ``loss`` (main next-token loss, per-token mean), ``grad_norm`` (before clipping),
    ``num_tokens``, ``lr``; with loss scaling ``loss_scale`` (used by this step) and ``skipped``
    (1.0 when skipped); with MTP ``mtp_<k>_loss`` (per-token mean of depth k = 1..D); with MoE
    layers the router's (``lmfunc.model.moe.router_metrics``).

    MoE layers: the router losses join the gradient inside ``loss_fn``; after the update, every
    router's ``expert_bias`` (aux-loss-free balancing; no gradient) takes its step from the pairs
    its experts took over all microbatches (``moe.updated_expert_biases``), on skipped steps too,
    as Megatron updates it before its optimizer step.
    """
    dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0

    def main_loss(out: LossOutput) -> torch.Tensor:
        """A microbatch's share before normalisation: its token-loss sum, or its per-token mean."""
        return out.loss_sum if calculate_per_token_loss else out.loss_sum / torch.clamp(out.num_tokens, min=1.0)

    def objective(params, micro: Batch, grad_scale: torch.Tensor, seed):
        out = loss_fn(cast_params(params, compute_dtype), micro, cfg, seed, grad_scale, calculate_per_token_loss)
        return main_loss(out) * grad_scale, out

    grad_fn = value_and_grad(objective, has_aux=True)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        check_batch(batch)
        if loss_scale is not None and state.loss_scale is None:
            raise ValueError("make_train_step(loss_scale=...) needs a state made with TrainState.create(..., loss_scale=...)")
        num_micro, micro_batch = batch["tokens"].shape[:2]
        device = batch["tokens"].device
        if "loss_mask" in batch:
            num_tokens = batch["loss_mask"].to(torch.float32).sum()
        else:
            num_tokens = torch.tensor(float(batch["tokens"].numel()), device=device)
        denominator = torch.clamp(num_tokens, min=1.0)
        normaliser = 1.0 / denominator if calculate_per_token_loss else torch.tensor(1.0 / num_micro, device=device)
        scale = state.loss_scale.scale if loss_scale is not None else None
        grad_scale = normaliser * scale if scale is not None else normaliser
        loss_total = torch.zeros((), dtype=torch.float32, device=device)
        mtp_sums = mtp_counts = torch.zeros(cfg.mtp_num_layers, device=device)
        router = None
        grad_leaves = None
        for i in range(num_micro):
            with mark_microbatch(i):
                micro = {k: v[i] for k, v in batch.items()}
            seed = microbatch_seed(state, i) if dropout else None
            (_, out), grads = grad_fn(state.params, micro, grad_scale, seed)
            leaves = tree_leaves(grads)
            if grad_leaves is None:
                grad_leaves = leaves
            else:
                with mark_accumulation(i):
                    grad_leaves = foreach_add(grad_leaves, leaves)
            loss_total = loss_total + main_loss(out)
            if cfg.mtp_num_layers:
                mtp_sums, mtp_counts = mtp_sums + out.mtp_loss_sums, mtp_counts + out.mtp_num_tokens
            if out.router is not None:
                router = out.router if router is None else moe.RouterStats(*(a + b for a, b in zip(router, out.router)))
        found_inf = None
        if scale is not None:
            grad_leaves = foreach_div(grad_leaves, scale)
            found_inf = ~all_finite(grad_leaves)
        grads = match_placements(tree_unflatten_as(state.params, grad_leaves), state.params)
        if clip_grad > 0:
            grads, grad_norm = clip_by_global_norm_with_norm(grads, clip_grad)
        else:
            grad_norm = global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = apply_updates(state.params, updates)
        metrics = {
            "loss": loss_total * normaliser, "grad_norm": grad_norm, "num_tokens": num_tokens,
        }
        params, opt_state, new_loss_scale, optimizer_steps = skip_on_overflow(
            state, params, opt_state, found_inf, loss_scale, metrics)
        for k in range(cfg.mtp_num_layers):
            metrics[f"mtp_{k + 1}_loss"] = mtp_sums[k] / torch.clamp(mtp_counts[k], min=1.0)
        if router is not None:
            params = moe.updated_expert_biases(params, router.load, cfg)
            metrics |= moe.router_metrics(router, num_micro, cfg)
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(optimizer_steps)
        metrics = full_metrics(metrics)
        if donate_state:
            params = write_into(state.params, params)
            opt_state = write_into(state.opt_state, opt_state)
        new_state = state.replace(
            params=params,
            opt_state=opt_state,
            step=state.step + 1,
            consumed_samples=state.consumed_samples + num_micro * micro_batch,
            loss_scale=new_loss_scale,
        )
        return new_state, metrics

    check = (lambda state: check_no_shared_storage((state.params, state.opt_state))) if donate_state else None
    return _callable_step(train_step, compile, backend, before=check, precompile=precompile,
                          bucket_size_mb=bucket_size_mb)


def skip_on_overflow(state: TrainState, params: PyTree, opt_state: PyTree, found_inf: Optional[torch.Tensor],
                     loss_scale: Optional[LossScaleConfig], metrics: Metrics):
    """The update's outcome under loss scaling: with ``found_inf`` (non-finite gradients) the old
    params and optimizer state, the scaler's next state, and ``loss_scale``/``skipped`` added to
    ``metrics``; returns ``(params, opt_state, loss_scale_state, optimizer_steps)``, the last the
    steps that updated (the lr schedule's position). Without loss scaling everything passes."""
    if found_inf is None:
        return params, opt_state, state.loss_scale, state.step
    params = select_tree(found_inf, state.params, params)
    opt_state = select_tree(found_inf, state.opt_state, opt_state)
    metrics |= {"loss_scale": state.loss_scale.scale, "skipped": found_inf.to(torch.float32)}
    return (params, opt_state, update_loss_scale(state.loss_scale, found_inf, loss_scale),
            state.step - state.loss_scale.skipped_steps)


def _is_donated(leaf) -> bool:
    """Whether a donating step writes into this leaf: every tensor but 0-dim ones (the update
    counters). Every update op reads the counters, so writing into them would make Inductor
    materialise each such op's value before the write (about twice the IR nodes to compile),
    and keeping them saves nothing."""
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def write_into(old: PyTree, new: PyTree) -> PyTree:
    """Copy every donated leaf of ``new`` into the matching leaf of ``old`` (in place). Returns a
    tree of ``old``'s structure holding ``old``'s donated leaves and ``new``'s other leaves.

    One ``tree_map`` over both trees, which Dynamo maps natively: a walk of its own cost Dynamo
    11k traced instructions for the bench's AdamW state, ``tree_flatten`` + ``tree_unflatten`` of
    both trees 54k. A ``new`` of another structure (containers, keys, a non-tensor where a
    donated tensor was) is a ``ValueError``; dict keys are matched by name."""

    def write(target, value):
        if not _is_donated(target):
            return value
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"a {type(value).__name__} where the state holds a tensor")
        if target is not value:
            target.copy_(value)
        return target

    try:
        return tree_map(write, old, new)
    except ValueError as error:
        raise ValueError(
            f"make_train_step(donate_state=True): the optimizer returned a state of another structure than "
            f"the one it was given ({error}); a donating step needs the update to keep the state's "
            "structure (or build the step with donate_state=False)"
        ) from None


def _storage_key(leaf) -> Optional[tuple]:
    """(device, storage address) of a donated leaf's (local) storage; None for other leaves, empty
    storage and fake tensors (a dry run's state, ``lmfunc.dryrun``), which have no data."""
    if not _is_donated(leaf):
        return None
    local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
    if is_fake(local):
        return None
    storage = local.untyped_storage()
    return (local.device, storage.data_ptr()) if storage.nbytes() else None


def check_no_shared_storage(tree: PyTree) -> None:
    """Raise a ``ValueError`` naming two leaves of ``tree`` that share storage: a donating step
    would write two different new values into one tensor. Runs before every donating step, so the
    paths are only built when two leaves do share."""
    keys = [key for key in map(_storage_key, tree_leaves(tree)) if key is not None]
    if len(set(keys)) == len(keys):
        return
    seen: dict[tuple, str] = {}
    for path, leaf in flatten_with_paths(tree):
        key = _storage_key(leaf)
        if key is None:
            continue
        if key in seen:
            raise ValueError(
                f"make_train_step(donate_state=True): state leaves {seen[key]!r} and {path!r} share storage, so the "
                "in-place update would write both into one tensor; give each leaf its own tensor (.clone()) "
                "or build the step with donate_state=False"
            )
        seen[key] = path
