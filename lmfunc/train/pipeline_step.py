"""The train step of a pipeline-parallel rank: torch's pipeline schedules over thin stage modules
that call lmfunc's pure functions, then the same update as ``make_train_step``, with the global
gradient norm and the overflow flag reduced over the pipeline.

``make_pipeline_train_step(...)(state, batch) -> (state, metrics)`` keeps the functional
signature: ``state.params`` is this rank's part of the parameter tree (the union of its stages'
``stage_params``, model-wide names), and every rank gets its data-parallel part of the batch
``[M, B, S]`` (all of it without data parallelism).

- **Data.** The first stage takes the tokens; every stage takes ``position_ids`` and ``doc_ids``
  (RoPE and the document mask are computed on each stage) and its microbatch's dropout seed; the
  last stage takes the labels, the loss mask and, with MTP, the tokens. torch's schedules split
  keyword arguments into microbatches and give them to every stage, so every rank loads its whole
  part of the batch: a few integer tensors (Megatron's middle stages load nothing).
- **Beside data and tensor parallelism** (``mesh``). Each pipeline rank's leaves are DTensors on
  the mesh's other dims, sharded by the same rules as without a pipeline. Stages pass plain local
  tensors (``stage_placements``: the batch split over the data-parallel dims; with sequence
  parallelism the hidden states also split along the sequence over ``tp``), and each stage makes
  them DTensors again, so the model code is unchanged and DTensor's autograd does the FSDP
  reduce-scatters and the tensor-parallel reductions inside each stage's backward. The pipeline
  group is the mesh's ``pp`` dim, and the embedding group pairs the first and the last stage at
  each data- and tensor-parallel coordinate.
- **Loss.** The last stage computes ``lm_loss_of_hidden`` and returns its microbatch's share of
  the step's objective, already divided by the step's token count and multiplied by the loss
  scale, so the schedule must not rescale: ``scale_grads=False``.
- **MoE layers.** Each stage's MoE layers attach their router losses in that stage (the gradient
  scale of ``lm_loss``'s, from the microbatch's token count), and its module records their
  ``RouterStats`` per microbatch. The step places them at their layers' rows of the whole model
  and sums them over the pipeline group with the loss metrics: every rank logs every layer's
  router metrics and moves the expert biases it holds by its layers' loads, as ``make_train_step``.
- **Gradients.** The schedule's backward leaves each stage's gradients in its module's
  parameters, summed over the microbatches. The token embedding held by the first and the last
  stage (tied, or read by MTP: ``shared_leaves``) has its two gradients summed over the embedding
  group, as Megatron does. The global norm (each leaf counted once) and the overflow flag are
  reduced over the pipeline group, so every rank clips by the same factor and skips the same steps.
- **What is compiled.** The schedule drives each stage's forward and backward microbatch by
  microbatch, so a step is not one graph here. With ``compile`` each stage's function is compiled
  (``torch.compile``; AOTAutograd compiles its backward), and the update (unscaling, the overflow
  flag, the norm and its all-reduce over the pipeline, clipping, AdamW, the loss scaler) is one
  compiled function of this rank's state (``lmfunc.compiler.compile_step``). The schedules that
  split the backward (``SPLIT_BACKWARD``) run each compiled backward twice, for the input and then
  the weight gradients, so their stages compile and run under
  ``lmfunc.compiler.compiling.retained_backward_settings``. Without ``compile`` all of this runs
  eagerly.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from lmfunc.config.model import ModelConfig
from lmfunc.config.pipeline import SCHEDULES, SPLIT_BACKWARD, PipelineSplit, check_schedule_model
from lmfunc.compiler.compiling import compile_settings, compile_step, inductor_options, retained_backward_settings
from lmfunc.compiler.regather import stage_inductor_options
from lmfunc.loss import lm_loss_of_hidden
from lmfunc.optim import GradientTransformation
from lmfunc.optim.transforms import Schedule
from lmfunc.parallel.context import CP_DIM
from lmfunc.parallel.sharding import context_split, local_batch_to_dtensor, match_placements
from lmfunc.precision import LossScaleConfig
from lmfunc.model import moe
from lmfunc.model.stages import shared_leaves, stage_moe_layers, stage_params
from lmfunc.train.pipeline_groups import data_parallel_size, embedding_group, pipeline_groups
from lmfunc.train.pipeline_stages import StageModule, StageShapes, router_sums
from lmfunc.train.pipeline_update import pipeline_update
from lmfunc.train.state import TrainState
from lmfunc.train.step import (Batch, Metrics, check_batch, check_no_shared_storage, microbatch_seed)
from lmfunc.tree import PyTree, flatten_with_paths, tree_unflatten_as


BackendFor = Callable[[dict], Callable]
"""``backend_for(options)``: the Dynamo backend to compile a function with, given the Inductor
options lmfunc would compile it with."""


def make_pipeline_train_step(
    cfg: ModelConfig,
    tx: GradientTransformation,
    split: PipelineSplit,
    schedule: str,
    num_microbatches: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    clip_grad: float = 1.0,
    lr_schedule: Optional[Schedule] = None,
    compute_dtype: torch.dtype = torch.float32,
    loss_scale: Optional[LossScaleConfig] = None,
    device: torch.device = torch.device("cpu"),
    compile: bool = False,
    mesh: Optional[DeviceMesh] = None,
    donate_state: bool = False,
    backend_for: Optional[BackendFor] = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build this pipeline rank's ``step(state, batch) -> (state, metrics)`` (module docstring) for
    ``schedule`` (``lmfunc.config.pipeline.SCHEDULES``) over ``group`` (default: the world), with
    ``num_microbatches`` per step; the other arguments as ``make_train_step`` (the loss per token
    over the whole step, as ``calculate_per_token_loss``). ``step.schedule()`` returns torch's
    schedule object once the first call has built it (for benchmarks that time its stages).

    ``mesh``: the run's mesh, a ``pp`` dim with data- and tensor-parallel dims beside it (instead of
    ``group``). The state's leaves are then DTensors on the other dims (``data_mesh``), the batch is
    this rank's data-parallel part ``[M, B / dp, S]`` (plain tensors), and the token count, the
    gradients' data-parallel reductions and the metrics cover the whole mesh.

    ``donate_state``: the update writes the new params and optimizer state into the input state's
    tensors, as ``make_train_step(donate_state=True)`` does; compiled, it then needs no second copy
    of this rank's params and Adam moments. The input state must not be used afterwards.

    ``backend_for``: with ``compile``, ``backend_for(options)`` is the Dynamo backend each function is
    compiled with instead of Inductor with the Inductor ``options`` lmfunc gives it (the dry run's
    capture, ``lmfunc.dryrun``)."""
    if cfg.scan_layers:
        raise ValueError("pipeline parallelism runs the unstacked layers: turn model.scan_layers off")
    check_schedule_model(schedule, cfg.tie_embeddings, cfg.mtp_num_layers, compile)
    group, data = pipeline_groups(group, mesh)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world != split.pp:
        raise ValueError(f"the pipeline group has {world} ranks but the split has parallel.pp = {split.pp}")
    dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0

    def objective(params, hidden, micro, dropout_seed, grad_scale):
        out = lm_loss_of_hidden(params, hidden, micro, cfg, dropout_seed, grad_scale, True)
        return (out.loss_sum * grad_scale).reshape(1), out

    first_rank, last_rank = split.rank_of_stage(0), split.rank_of_stage(split.num_stages - 1)
    shared = set(shared_leaves(cfg, split))
    moe_layers = moe.moe_layer_names(cfg)
    held_moe_layers = sorted(i for stage in split.stages_of_rank(rank) for i in stage_moe_layers(cfg, split, stage))
    tied_group = (embedding_group(group, mesh, sorted({first_rank, last_rank}))
                  if shared and first_rank != last_rank else None)
    modules: dict[int, StageModule] = {}
    runtime: dict = {}

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        check_batch(batch)
        num_micro, micro_batch, seq = batch["tokens"].shape
        if num_micro != num_microbatches:
            raise ValueError(f"the batch has {num_micro} microbatches but the pipeline step was built for "
                             f"{num_microbatches}")
        num_tokens = _token_count(batch, data)
        normaliser = 1.0 / torch.clamp(num_tokens, min=1.0)
        scale = state.loss_scale.scale if loss_scale is not None else None
        grad_scale = normaliser * scale if scale is not None else normaliser
        first_call = not modules
        local = _context_part(batch, data)
        if first_call:
            shapes = StageShapes.of(local["tokens"], cfg, compute_dtype, data, requires_grad=True)
            runtime["schedule"] = _build_schedule(state.params, cfg, split, schedule, num_microbatches, group, device,
                                                  compute_dtype, objective, modules, compile, data, shapes, backend_for)
        for stage, module in modules.items():
            module.bind(stage_params(state.params, cfg, split, stage), grad_scale)
        seeds = (torch.stack([microbatch_seed(state, i) for i in range(num_micro)]).reshape(num_micro, 1)
                 if dropout else None)
        args, kwargs = _schedule_inputs(local, seeds, first_rank == rank, last_rank == rank)
        with _schedule_context(compile, first_call, schedule, data is not None):
            runtime["schedule"].step(*args, **kwargs)
        grads = _gather_grads(state.params, modules)
        if data is not None:
            grads = match_placements(grads, state.params)
        if tied_group is not None and rank in (first_rank, last_rank):
            embedding = grads["embed"]["tokens"]
            dist.all_reduce(embedding.to_local() if isinstance(embedding, DTensor) else embedding,
                            group=tied_group)
        sums = _metric_sums(modules, num_micro, 1 + 2 * cfg.mtp_num_layers, device, lambda out: torch.cat(
            [out.loss_sum.reshape(1), out.mtp_loss_sums, out.mtp_num_tokens]))
        if moe_layers:
            sums = torch.cat([sums, router_sums(modules, num_micro, len(moe_layers), cfg.num_experts, device)])
        dp = data_parallel_size(data)
        if donate_state:
            check_no_shared_storage((state.params, state.opt_state))
        with implicit_replication() if data is not None else contextlib.nullcontext():
            return run_update(state, grads, sums, normaliser, num_tokens, num_micro * micro_batch * dp)

    def update(state: TrainState, grads: PyTree, sums: torch.Tensor, normaliser: torch.Tensor,
               num_tokens: torch.Tensor, consumed: int) -> tuple[TrainState, Metrics]:
        return pipeline_update(state, grads, sums, tx, clip_grad, loss_scale, group, lr_schedule, cfg, normaliser, num_tokens,
                       counted=lambda path: path not in shared or rank == first_rank, consumed=consumed,
                       donate=donate_state, num_micro=num_microbatches, held_moe_layers=held_moe_layers)

    run_update = update
    if compile:
        update_options = inductor_options(True, None)
        run_update = compile_step(update, backend_for(update_options) if backend_for else "inductor", bucket_size_mb=None)
    step.schedule = lambda: runtime.get("schedule")  # torch's schedule object, once built (benchmarks)
    return step


@contextlib.contextmanager
def _schedule_context(compiled: bool, first_call: bool, schedule: str, on_mesh: bool):
    """Around a schedule call: with ``compiled`` stages, ``compile_settings`` while they compile (on
    the ``first_call``: their backward compiles at the first backward, inside the call) and, where
    ``schedule`` splits the backward, ``retained_backward_settings`` on every call;
    ``implicit_replication`` on a data mesh (plain tensors made inside the stages count as
    replicated)."""
    with contextlib.ExitStack() as context:
        if compiled and first_call:
            context.enter_context(compile_settings())
        if compiled and schedule in SPLIT_BACKWARD:
            context.enter_context(retained_backward_settings())
        if on_mesh:
            context.enter_context(implicit_replication())
        yield


def _token_count(batch: Batch, data_mesh: Optional[DeviceMesh]) -> torch.Tensor:
    """The loss tokens of the whole step's global batch (``batch`` is this rank's data-parallel part)."""
    if "loss_mask" not in batch:
        return torch.tensor(float(batch["tokens"].numel() * data_parallel_size(data_mesh)),
                            device=batch["tokens"].device)
    if data_mesh is None:
        return batch["loss_mask"].to(torch.float32).sum()
    mask = local_batch_to_dtensor({"loss_mask": batch["loss_mask"]}, data_mesh)["loss_mask"]
    return mask.to(torch.float32).sum().full_tensor()


def _metric_sums(modules: dict, num_micro: int, size: int, device: torch.device, fields: Callable) -> torch.Tensor:
    """The sum over this rank's last-stage outputs of this step of ``fields(out)`` (``size``
    numbers; zeros on ranks without the last stage), reduced over the data mesh: a plain tensor.
    The last ``num_micro`` outputs: on its first step a PipelineStage also runs the forward once to
    infer shapes."""
    total = None
    for module in modules.values():
        for out in module.outputs[len(module.outputs) - num_micro:]:
            total = fields(out) if total is None else total + fields(out)
    if total is None:
        return torch.zeros(size, device=device)
    return total.full_tensor() if isinstance(total, DTensor) else total


def make_pipeline_eval_step(
    cfg: ModelConfig,
    split: PipelineSplit,
    schedule: str,
    num_microbatches: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    compile: bool = False,
    mesh: Optional[DeviceMesh] = None,
) -> Callable[[PyTree, Batch], Metrics]:
    """This pipeline rank's ``eval_step(params, batch) -> {"loss_sum", "num_tokens"}`` (as
    ``make_eval_step``; equal on every rank): ``schedule``'s forward-only pass (torch's
    ``schedule.eval``, no gradients kept) over the ``num_microbatches`` microbatches of ``batch``,
    the main next-token loss only, no dropout. ``params`` is this rank's part of the tree. Where a
    rank runs two consecutive stages (the V schedules zbv and dualpipev; one rank with virtual
    stages) it runs a whole step instead and discards its gradients: torch 2.13's forward-only pass
    fails there. ``mesh`` as for ``make_pipeline_train_step``."""
    if cfg.scan_layers:
        raise ValueError("pipeline parallelism runs the unstacked layers: turn model.scan_layers off")
    group, data = pipeline_groups(group, mesh)
    rank = dist.get_rank(group)
    first_rank, last_rank = split.rank_of_stage(0), split.rank_of_stage(split.num_stages - 1)
    modules: dict[int, StageModule] = {}
    runtime: dict = {}
    # torch 2.13's forward-only pass fails where one rank runs two consecutive stages (the V
    # schedules; one rank with virtual stages): "can't steal_bwd_input if this stage doesn't have
    # backward". Those evaluate with a whole step, whose gradients are discarded.
    forward_only = all(split.rank_of_stage(s) != split.rank_of_stage(s + 1) for s in range(split.num_stages - 1))

    def objective(params, hidden, micro, dropout_seed, grad_scale):
        out = lm_loss_of_hidden(params, hidden, micro, cfg)
        return out.loss_sum.reshape(1), out

    def eval_step(params: PyTree, batch: Batch) -> Metrics:
        check_batch(batch)
        if batch["tokens"].shape[0] != num_microbatches:
            raise ValueError(f"the batch has {batch['tokens'].shape[0]} microbatches but the pipeline eval step was "
                             f"built for {num_microbatches}")
        first_call = not modules
        local = _context_part(batch, data)
        if first_call:
            shapes = StageShapes.of(local["tokens"], cfg, compute_dtype, data, requires_grad=not forward_only)
            runtime["schedule"] = _build_schedule(params, cfg, split, schedule, num_microbatches, group, device,
                                                  compute_dtype, objective, modules, compile, data, shapes)
        for stage, module in modules.items():
            module.bind(stage_params(params, cfg, split, stage))
        args, kwargs = _schedule_inputs(local, None, first_rank == rank, last_rank == rank)
        with _schedule_context(compile, first_call, schedule, data is not None):
            if forward_only:
                with torch.no_grad():
                    runtime["schedule"].eval(*args, **kwargs)
            else:
                runtime["schedule"].step(*args, **kwargs)
        sums = _metric_sums(modules, num_microbatches, 2, device, lambda out: torch.stack(
            [out.loss_sum.float(), out.num_tokens.float()]))
        dist.all_reduce(sums, group=group)
        return {"loss_sum": sums[0], "num_tokens": sums[1]}

    return eval_step


def _build_schedule(params: PyTree, cfg: ModelConfig, split: PipelineSplit, schedule: str, num_microbatches: int,
                    group: dist.ProcessGroup, device: torch.device, compute_dtype: torch.dtype, objective: Callable,
                    modules: dict, compile: bool, data_mesh: Optional[DeviceMesh], shapes: StageShapes,
                    backend_for: Optional[BackendFor] = None):
    """torch's ``schedule`` over this rank's stage modules (made into ``modules``), for
    ``num_microbatches`` microbatches, each stage given its input and output ``shapes`` (so torch
    needs no metadata exchange between the ranks at the first step). The last stage returns its
    objective, so the loss function is a sum and the schedule must not rescale the gradients
    (``scale_grads=False``)."""
    my_stages = split.stages_of_rank(dist.get_rank(group))
    for stage in my_stages:
        modules[stage] = StageModule(stage_params(params, cfg, split, stage), cfg, split, stage, compute_dtype,
                                      objective, compile, data_mesh, split_backward=schedule in SPLIT_BACKWARD,
                                      backend=backend_for(stage_inductor_options()) if backend_for else "inductor")
    stages = [pipelining.PipelineStage(modules[s], s, split.num_stages, device, group=group,
                                       input_args=shapes.inputs(split, s),
                                       output_args=shapes.outputs(split, s)) for s in my_stages]
    loss_fn = lambda output, target: output.sum()  # noqa: E731
    schedule_cls = getattr(pipelining, SCHEDULES[schedule][0])
    return schedule_cls(stages[0] if SCHEDULES[schedule][1] == 1 else stages, num_microbatches, loss_fn=loss_fn,
                        scale_grads=False)


def _context_part(batch: Batch, data_mesh: Optional[DeviceMesh]) -> Batch:
    """This rank's part of every field of ``batch`` ``[M, B, S]`` on a data mesh with ``cp``: each
    sequence in load-balanced order and split over ``cp`` (``lmfunc.parallel.context``), with the
    tokens' original indices as ``position_ids`` when the batch has none; ``batch`` otherwise."""
    if data_mesh is None or CP_DIM not in data_mesh.mesh_dim_names:
        return batch
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[-1], device=tokens.device).expand(tokens.shape)
    return context_split({"position_ids": positions, **batch}, data_mesh)


def _schedule_inputs(batch: Batch, seeds: Optional[torch.Tensor], first: bool, last: bool) -> tuple[tuple, dict]:
    """The positional and keyword arguments of ``schedule.step``/``eval`` for a rank holding the
    first and/or the last stage: ``batch`` ``[M, B, S]`` flattened to ``[M * B, S]`` (the schedule
    splits it back into M microbatches), ``seeds`` ``[M, 1]`` the dropout seeds (None: no dropout)."""
    num_micro, micro_batch, seq = batch["tokens"].shape
    device = batch["tokens"].device
    flat = {k: v.reshape(num_micro * micro_batch, *v.shape[2:]) for k, v in batch.items()}
    positions = flat.get("position_ids", torch.arange(seq, device=device).expand(num_micro * micro_batch, seq))
    kwargs = {"position_ids": positions,
              "seed": seeds if seeds is not None else torch.zeros(num_micro, 0, dtype=torch.int64, device=device)}
    if "doc_ids" in flat:
        kwargs["doc_ids"] = flat["doc_ids"]
    if last:
        kwargs |= {"labels": flat["labels"], "tokens": flat["tokens"]}
        if "loss_mask" in flat:
            kwargs["loss_mask"] = flat["loss_mask"]
    kwargs["target"] = flat["labels"] if last else None
    return ((flat["tokens"],) if first else ()), kwargs


def _gather_grads(params: PyTree, modules: dict) -> PyTree:
    """This rank's gradients in the shape of its ``state.params``: each stage's module gradients,
    summed where two of its stages hold the same leaf."""
    sums: dict[str, torch.Tensor] = {}
    for module in modules.values():
        for path, grad in zip(module.paths, module.grads()):
            sums[path] = sums[path] + grad if path in sums else grad
    return tree_unflatten_as(params, [sums[path] for path, _ in flatten_with_paths(params)])
