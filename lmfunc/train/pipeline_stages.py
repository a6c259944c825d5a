"""``StageModule``: what torch's ``PipelineStage`` runs for one pipeline stage, a thin
``nn.Module`` over the stage's leaves (``lmfunc.model.stages.stage_params``) and
``stage_forward`` (and, on the last stage, the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lmfunc.compiler.compiling import with_own_code
from lmfunc.compiler.regather import stage_inductor_options
from lmfunc.config.model import ModelConfig
from lmfunc.config.pipeline import PipelineSplit
from lmfunc.loss import LossOutput
from lmfunc.loss.next_token import router_grad_scale
from lmfunc.model.moe import RouterStats
from lmfunc.model.stages import stage_forward, stage_moe_layers
from lmfunc.parallel.context import CP_DIM
from lmfunc.parallel.placement import DATA_PARALLEL_DIMS
from lmfunc.precision import cast_params
from lmfunc.tree import PyTree, flatten_with_paths, tree_unflatten_as


class StageModule(nn.Module):
    """One stage for torch's ``PipelineStage``: its leaves as parameters (rebound to the state's
    tensors each step) and ``stage_forward``; on the last stage also the loss, whose per-microbatch
    ``LossOutput`` it records for the step's metrics, as it records its MoE layers' ``RouterStats``
    (``router_stats``, for its ``moe_layers``). With ``compile`` the stage's function is
    compiled (``torch.compile``, Inductor or ``backend``): AOTAutograd compiles its backward with it,
    and Inductor gathers FSDP-sharded parameters again in the backward (``lmfunc.compiler.regather``).

    On a ``data_mesh`` (the data- and tensor-parallel dims of this pipeline rank) the leaves are
    DTensors and the stage takes and returns plain local tensors, this rank's part of each
    microbatch (``stage_placements``): inside they become DTensors, so the model runs exactly as
    without a pipeline, and the placements' autograd reduces the gradients. ``split_backward``
    (schedules that split the backward, which detach each stage output in place after its input
    pass) makes those local outputs tensors of their own: a DTensor's local tensor is a view, and a
    view cannot be detached in place."""

    def __init__(self, template: PyTree, cfg: ModelConfig, split: PipelineSplit, stage: int,
                 compute_dtype: torch.dtype, objective: Callable, compile: bool,
                 data_mesh: Optional[DeviceMesh] = None, split_backward: bool = False,
                 backend: Union[str, Callable] = "inductor") -> None:
        super().__init__()
        self.template, self.cfg, self.split, self.stage = template, cfg, split, stage
        self.data_mesh, self.split_backward = data_mesh, split_backward
        self.paths = [path for path, _ in flatten_with_paths(template)]
        self.weights = nn.ParameterList(nn.Parameter(leaf.detach(), requires_grad=leaf.is_floating_point())
                                        for _, leaf in flatten_with_paths(template))
        self.compute_dtype, self.objective, self.outputs = compute_dtype, objective, []
        self.moe_layers, self.router_stats = stage_moe_layers(cfg, split, stage), []
        self.grad_scale: Optional[torch.Tensor] = None
        self.run = self._run
        if compile:
            options = stage_inductor_options() if backend == "inductor" else None
            self.run = torch.compile(with_own_code(_stage_function(self)), fullgraph=True, dynamic=False,
                                     backend=backend, options=options)

    def bind(self, params: PyTree, grad_scale: Optional[torch.Tensor] = None) -> None:
        """Use ``params`` (this stage's subtree) for the next step, whose objective is multiplied by
        ``grad_scale``. The parameter objects stay (torch's schedules hold them: zero bubble computes
        weight gradients from ``parameters()``); their data becomes the state's tensors (no copy)
        and their gradients are cleared. A DTensor parameter's contents are swapped in
        (``torch.utils.swap_tensors``): assigning ``.data`` leaves its local shard unchanged."""
        self.outputs, self.router_stats, self.grad_scale = [], [], grad_scale
        for weight, (_, leaf) in zip(self.weights, flatten_with_paths(params)):
            weight.grad = None
            if isinstance(leaf, DTensor):
                torch.utils.swap_tensors(weight, nn.Parameter(leaf.detach(), requires_grad=weight.requires_grad))
            else:
                weight.data = leaf.detach()

    def grads(self) -> list[torch.Tensor]:
        """Each leaf's gradient after a schedule step (zeros for a leaf it never reached), laid out
        like the leaf. torch's split backward (``stage_backward_weight``) stores the gradient it
        computes as it comes, so the tied output layer's, computed for the transposed view ``E.T``,
        arrives as a transposed view of a ``[h, V]`` buffer; collectives read a tensor's storage
        in order (gloo's all-reduce sums such a view with the other rank's ``[V, h]`` gradient
        element by storage element, silently), and the update expects the leaf's layout."""
        return [_like(p.grad, p) if p.grad is not None else torch.zeros_like(p) for p in self.weights]

    def forward(self, x, position_ids, seed, doc_ids=None, labels=None, loss_mask=None, tokens=None):
        result, *fields = self.run(list(self.weights), x, position_ids, seed, doc_ids, labels, loss_mask, tokens,
                                   self.grad_scale)
        if self.moe_layers:
            self.router_stats.append(RouterStats(*fields[-len(RouterStats._fields):]))
            fields = fields[:-len(RouterStats._fields)]
        if self.split.holds_head(self.stage):
            self.outputs.append(LossOutput(*fields))
        return result

    def _run(self, weights, x, position_ids, seed, doc_ids, labels, loss_mask, tokens, grad_scale):
        """The tuple of the stage's hidden states ``[B, S, h]`` (on the last stage its objective and
        ``LossOutput``'s tensors instead), then, where the stage runs MoE layers, their
        ``RouterStats`` fields stacked over those layers (``stage_moe_layers`` order)."""
        params = cast_params(tree_unflatten_as(self.template, weights), self.compute_dtype)
        dropout_seed = seed[0] if seed.numel() else None
        mesh = _leaves_mesh(weights, self.data_mesh)
        if mesh is not None:
            batch_placements, hidden_placements = stage_placements(mesh, self.cfg.sequence_parallel)
            x = DTensor.from_local(x, mesh, batch_placements if self.split.holds_embedding(self.stage)
                                   else hidden_placements, run_check=False)
            position_ids, doc_ids, labels, loss_mask, tokens = (
                None if t is None else DTensor.from_local(t, mesh, batch_placements, run_check=False)
                for t in (position_ids, doc_ids, labels, loss_mask, tokens))
        hidden, stats = stage_forward(params, x, self.cfg, self.split, self.stage, position_ids, doc_ids,
                                      dropout_seed, router_grad_scale(position_ids.numel(), grad_scale, True))
        if not self.split.holds_head(self.stage):
            if mesh is not None:
                if list(hidden.placements) != hidden_placements:
                    hidden = hidden.redistribute(mesh, hidden_placements)
                hidden = hidden.to_local().clone() if self.split_backward else hidden.to_local()
            return (hidden, *_router_fields(stats))
        micro = {"tokens": tokens, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}
        if loss_mask is not None:
            micro["loss_mask"] = loss_mask
        micro = {k: v for k, v in micro.items() if v is not None}
        value, out = self.objective(params, hidden, micro, dropout_seed, grad_scale)
        if isinstance(value, DTensor):
            # this rank's share of the objective (a Partial sum over the data-parallel dims); its
            # gradient is 1 on every rank, a replicated one
            value = value.to_local(grad_placements=[Replicate()] * mesh.ndim)
        # the fields are metrics only: detached, so a compiled stage's backward needs no tangent for them
        loss_fields = (field.detach() for field in out[:4])
        return (value, *loss_fields, *_router_fields(stats + ([out.router] if out.router is not None else [])))


def _leaves_mesh(weights: list, data_mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
    """The mesh object the stage's DTensor leaves live on when it is ``data_mesh``'s layout, else
    ``data_mesh``. The stage makes its batch and hidden states DTensors on it: on the leaves' own
    object, every DTensor the compiled stage returns (the last stage's loss metrics) is on a mesh
    the graph takes as input. On another object (an equal one: the trainer builds the state's mesh
    and the step's separately), torch 2.13 may return the metrics' mesh through
    ``device_mesh._get_submesh``, which Inductor cannot lower, and the trainer's compiled last stage
    beside dp_shard fails at its first step (``tests/test_train_pipeline.py``)."""
    if data_mesh is None:
        return None
    for weight in weights:
        if isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == data_mesh.mesh_dim_names:
            return weight.device_mesh
    return data_mesh


@dataclass(frozen=True)
class StageShapes:
    """What a pipeline stage takes and returns, per microbatch, on this rank: the tokens ``[B, S]``
    (int64) into the first stage, the hidden states ``[B, S', h]`` (the compute dtype; ``S'`` is
    ``S / tp`` with sequence parallelism) between stages, and the last stage's objective ``[1]``
    (float32). ``B`` and ``S`` are this rank's part of a microbatch (split over the data-parallel
    dims and ``cp``). ``requires_grad``: the step runs a backward through them."""

    micro_batch: int
    seq: int
    hidden_seq: int
    hidden_size: int
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tokens: torch.Tensor, cfg: ModelConfig, compute_dtype: torch.dtype, data_mesh: Optional[DeviceMesh],
           requires_grad: bool) -> "StageShapes":
        """The shapes for this rank's part of a batch, ``tokens`` ``[M, B, S]``."""
        _, micro_batch, seq = tokens.shape
        names = data_mesh.mesh_dim_names if data_mesh is not None else ()
        tp = data_mesh.size(names.index("tp")) if cfg.sequence_parallel and "tp" in names else 1
        return StageShapes(micro_batch, seq, seq // tp, cfg.hidden_size, compute_dtype, requires_grad)

    def _hidden(self) -> torch.Tensor:
        return torch.empty(self.micro_batch, self.hidden_seq, self.hidden_size, dtype=self.dtype, device="meta",
                           requires_grad=self.requires_grad)

    def inputs(self, split: PipelineSplit, stage: int) -> tuple[torch.Tensor, ...]:
        """Stage ``stage``'s positional input (meta tensors: shapes only)."""
        if split.holds_embedding(stage):
            return (torch.empty(self.micro_batch, self.seq, dtype=torch.int64, device="meta"),)
        return (self._hidden(),)

    def outputs(self, split: PipelineSplit, stage: int) -> tuple[torch.Tensor, ...]:
        """Stage ``stage``'s output (meta tensors: shapes only)."""
        if split.holds_head(stage):
            return (torch.empty(1, dtype=torch.float32, device="meta", requires_grad=self.requires_grad),)
        return (self._hidden(),)


def _router_fields(stats: list[RouterStats]) -> tuple[torch.Tensor, ...]:
    """The ``RouterStats`` of a stage's MoE layers stacked over the layers and detached: ``(load
    [L, E], losses [L, 3], dropped [L])`` (DTensors on a data mesh); nothing without MoE layers. A
    layer's stats are unstacked (``load`` ``[E]``), the MTP depths' stacked already."""
    if not stats:
        return ()
    stacked = [s if s.load.dim() == 2 else RouterStats(*(f.unsqueeze(0) for f in s)) for s in stats]
    return tuple(torch.cat(field).detach() for field in zip(*stacked))


def router_sums(modules: dict, num_micro: int, num_layers: int, num_experts: int,
                 device: torch.device) -> torch.Tensor:
    """This rank's stages' ``RouterStats`` of this step, summed over its microbatches and placed at
    their layers' rows of the whole model's ``[L_moe, ...]`` (zeros elsewhere), flattened into one
    plain tensor ``[L_moe * (E + 4)]`` (load, losses, dropped; ``unpacked_router``) that a sum over
    the pipeline group completes."""
    load = torch.zeros(num_layers, num_experts, device=device)
    losses = torch.zeros(num_layers, 3, device=device)
    dropped = torch.zeros(num_layers, device=device)
    for module in modules.values():
        if not module.moe_layers:
            continue
        rows = torch.tensor(module.moe_layers, device=device)
        for stats in module.router_stats[len(module.router_stats) - num_micro:]:
            for total, field in zip((load, losses, dropped), stats):
                whole = field.full_tensor() if isinstance(field, DTensor) else field
                total.index_add_(0, rows, whole.to(total.dtype))
    return torch.cat([load.reshape(-1), losses.reshape(-1), dropped])


def unpacked_router(flat: torch.Tensor, num_experts: int) -> RouterStats:
    """The ``RouterStats`` ``router_sums`` flattened (after the sum over the pipeline group)."""
    num_layers = flat.numel() // (num_experts + 4)
    load, losses, dropped = flat.split([num_layers * num_experts, num_layers * 3, num_layers])
    return RouterStats(load.view(num_layers, num_experts), losses.view(num_layers, 3), dropped)


def _like(grad: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``leaf``'s memory layout (for DTensors, of the local shards): itself when the
    strides match, else a copy."""
    if isinstance(grad, DTensor):
        local = grad.to_local()
        if local.stride() == leaf.to_local().stride():
            return grad
        return DTensor.from_local(local.contiguous(), grad.device_mesh, grad.placements, run_check=False,
                                  shape=grad.shape, stride=leaf.stride())
    if grad.stride() == leaf.stride():
        return grad
    return torch.empty_like(leaf, dtype=grad.dtype).copy_(grad)


def stage_placements(mesh: DeviceMesh, sequence_parallel: bool) -> tuple[list, list]:
    """The placements on ``mesh`` of what a pipeline stage takes: batch fields ``[B, S]`` split along
    the batch over the data-parallel dims and along the sequence over ``cp`` (replicated over
    ``tp``), and hidden states ``[B, S, h]`` split likewise and, with sequence parallelism, along
    the sequence over ``tp``."""
    batch = [Shard(0) if name in DATA_PARALLEL_DIMS else Shard(1) if name == CP_DIM else Replicate()
             for name in mesh.mesh_dim_names]
    hidden = [Shard(1) if name == "tp" and sequence_parallel else p for name, p in zip(mesh.mesh_dim_names, batch)]
    return batch, hidden


def _stage_function(module: StageModule) -> Callable:
    """``module._run`` as a plain function (what ``with_own_code`` copies for ``torch.compile``)."""

    def run(weights, x, position_ids, seed, doc_ids, labels, loss_mask, tokens, grad_scale):
        return module._run(weights, x, position_ids, seed, doc_ids, labels, loss_mask, tokens, grad_scale)

    return run
