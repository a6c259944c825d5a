"""The parameters of each pipeline stage: subtrees of the model's pytree under their model-wide
names, so a stage's checkpoint shards line up with every other pp size's.

Stage ``s`` of a ``PipelineSplit`` (``lmfunc.config.pipeline``) holds ``layers.<i>`` for its
layers; the first stage also the embedding; the last stage the final norm, the untied output layer
and the MTP depths. The last stage also needs the token embedding when the output layer is tied to
it or when MTP runs (each depth embeds the shifted tokens): Megatron keeps a copy of the embedding
on the last stage and all-reduces its gradient over the "embedding group" (first and last stage).
``shared_leaves`` names those leaves; their gradients are summed across the stages holding them.

``StageModule`` is what torch's ``PipelineStage`` runs: a thin ``nn.Module`` over a stage's leaves
and ``stage_forward`` (and, on the last stage, the loss).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lmfunc.compiler.compiling import with_own_code
from lmfunc.config.model import ModelConfig
from lmfunc.config.pipeline import PipelineSplit
from lmfunc.loss import LossOutput
from lmfunc.model import gpt, layers
from lmfunc.parallel.placement import DATA_PARALLEL_DIMS
from lmfunc.precision import cast_params
from lmfunc.tree import PyTree, flatten_with_paths, tree_unflatten_as


def shared_leaves(cfg: ModelConfig, split: PipelineSplit) -> tuple[str, ...]:
    """Dotted names of the leaves held by both the first and the last stage (empty with one stage)."""
    if split.num_stages == 1 or not (cfg.tie_embeddings or cfg.mtp_num_layers > 0):
        return ()
    return ("embed.tokens",)


def stage_params(params: PyTree, cfg: ModelConfig, split: PipelineSplit, stage: int) -> PyTree:
    """The subtree of the (unstacked) parameter tree ``params`` that stage ``stage`` holds; leaves
    are the same tensors, not copies."""
    if cfg.scan_layers:
        raise ValueError("pipeline stages take the unstacked layer tree (model.scan_layers off)")
    if not 0 <= stage < split.num_stages:
        raise ValueError(f"stage {stage} is outside 0..{split.num_stages - 1}")
    held: dict = {"layers": {str(i): params["layers"][str(i)] for i in split.layers[stage]}}
    if split.holds_embedding(stage):
        held["embed"] = params["embed"]
    if split.holds_head(stage):
        held["final_norm"] = params["final_norm"]
        for name in ("output", "mtp"):
            if name in params:
                held[name] = params[name]
        if "embed.tokens" in shared_leaves(cfg, split) and "embed" not in held:
            held["embed"] = {"tokens": params["embed"]["tokens"]}
    return held


def stage_forward(params: PyTree, x: torch.Tensor, cfg: ModelConfig, split: PipelineSplit, stage: int,
                  positions: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                  dropout_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stage ``stage``'s part of ``gpt.forward`` over its ``stage_params``: ``x`` is the tokens
    ``[B, S]`` on the first stage and the previous stage's output ``[B, S, h]`` on the others; the
    result is ``[B, S, h]``, final-normed on the last stage. Every stage needs ``positions``
    (RoPE) and ``doc_ids`` (the document mask); composed over the stages this is ``gpt.forward``."""
    if split.holds_embedding(stage):
        x = gpt.embed_input(params, x, positions, cfg, dropout_seed)
    mask = layers.attention_mask(doc_ids) if doc_ids is not None else None
    x = gpt.run_layers(params, x, cfg, gpt.rope_for(positions, cfg), mask, dropout_seed, split.layers[stage])
    return gpt.final_hidden(params, x, cfg) if split.holds_head(stage) else x


def rank_params(params: PyTree, cfg: ModelConfig, split: PipelineSplit, rank: int) -> PyTree:
    """The part of the full (unstacked) parameter tree that pipeline rank ``rank`` holds: the union
    of its stages' ``stage_params``."""
    merged: dict = {}
    for stage in split.stages_of_rank(rank):
        for key, value in stage_params(params, cfg, split, stage).items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return merged


class StageModule(nn.Module):
    """One stage for torch's ``PipelineStage``: its leaves as parameters (rebound to the state's
    tensors each step) and ``stage_forward``; on the last stage also the loss, whose per-microbatch
    ``LossOutput`` it records for the step's metrics. With ``compile`` the stage's function is
    compiled (``torch.compile``, Inductor): AOTAutograd compiles its backward with it.

    On a ``data_mesh`` (the data- and tensor-parallel dims of this pipeline rank) the leaves are
    DTensors and the stage takes and returns plain local tensors, this rank's part of each
    microbatch (``stage_placements``): inside they become DTensors, so the model runs exactly as
    without a pipeline, and the placements' autograd reduces the gradients."""

    def __init__(self, template: PyTree, cfg: ModelConfig, split: PipelineSplit, stage: int,
                 compute_dtype: torch.dtype, objective: Callable, compile: bool,
                 data_mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        self.template, self.cfg, self.split, self.stage = template, cfg, split, stage
        self.data_mesh = data_mesh
        self.paths = [path for path, _ in flatten_with_paths(template)]
        self.weights = nn.ParameterList(nn.Parameter(leaf.detach(), requires_grad=leaf.is_floating_point())
                                        for _, leaf in flatten_with_paths(template))
        self.compute_dtype, self.objective, self.outputs = compute_dtype, objective, []
        self.grad_scale: Optional[torch.Tensor] = None
        self.run = self._run
        if compile:
            self.run = torch.compile(with_own_code(_stage_function(self)), fullgraph=True, dynamic=False)

    def bind(self, params: PyTree, grad_scale: Optional[torch.Tensor] = None) -> None:
        """Use ``params`` (this stage's subtree) for the next step, whose objective is multiplied by
        ``grad_scale``. The parameter objects stay (torch's schedules hold them: zero bubble computes
        weight gradients from ``parameters()``); their data becomes the state's tensors (no copy)
        and their gradients are cleared. A DTensor parameter's contents are swapped in
        (``torch.utils.swap_tensors``): assigning ``.data`` leaves its local shard unchanged."""
        self.outputs, self.grad_scale = [], grad_scale
        for weight, (_, leaf) in zip(self.weights, flatten_with_paths(params)):
            weight.grad = None
            if isinstance(leaf, DTensor):
                torch.utils.swap_tensors(weight, nn.Parameter(leaf.detach(), requires_grad=weight.requires_grad))
            else:
                weight.data = leaf.detach()

    def grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.weights]

    def forward(self, x, position_ids, seed, doc_ids=None, labels=None, loss_mask=None, tokens=None):
        result = self.run(list(self.weights), x, position_ids, seed, doc_ids, labels, loss_mask, tokens,
                          self.grad_scale)
        if not self.split.holds_head(self.stage):
            return result
        value, *out = result
        self.outputs.append(LossOutput(*out))
        return value

    def _run(self, weights, x, position_ids, seed, doc_ids, labels, loss_mask, tokens, grad_scale):
        """The stage's hidden states ``[B, S, h]``, or on the last stage the tuple (objective,
        ``LossOutput``'s fields)."""
        params = cast_params(tree_unflatten_as(self.template, weights), self.compute_dtype)
        dropout_seed = seed[0] if seed.numel() else None
        mesh = self.data_mesh
        if mesh is not None:
            batch_placements, hidden_placements = stage_placements(mesh, self.cfg.sequence_parallel)
            x = DTensor.from_local(x, mesh, batch_placements if self.split.holds_embedding(self.stage)
                                   else hidden_placements, run_check=False)
            position_ids, doc_ids, labels, loss_mask, tokens = (
                None if t is None else DTensor.from_local(t, mesh, batch_placements, run_check=False)
                for t in (position_ids, doc_ids, labels, loss_mask, tokens))
        hidden = stage_forward(params, x, self.cfg, self.split, self.stage, position_ids, doc_ids, dropout_seed)
        if not self.split.holds_head(self.stage):
            if mesh is None:
                return hidden
            if list(hidden.placements) != hidden_placements:
                hidden = hidden.redistribute(mesh, hidden_placements)
            return hidden.to_local()
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
        return (value, *(field.detach() for field in out))


def stage_placements(mesh: DeviceMesh, sequence_parallel: bool) -> tuple[list, list]:
    """The placements on ``mesh`` of what a pipeline stage takes: batch fields ``[B, S]`` split along
    the batch over the data-parallel dims (replicated over ``tp``), and hidden states ``[B, S, h]``
    split likewise and, with sequence parallelism, along the sequence over ``tp``."""
    batch = [Shard(0) if name in DATA_PARALLEL_DIMS else Replicate() for name in mesh.mesh_dim_names]
    hidden = [Shard(1) if name == "tp" and sequence_parallel else p for name, p in zip(mesh.mesh_dim_names, batch)]
    return batch, hidden


def _stage_function(module: StageModule) -> Callable:
    """``module._run`` as a plain function (what ``with_own_code`` copies for ``torch.compile``)."""

    def run(weights, x, position_ids, seed, doc_ids, labels, loss_mask, tokens, grad_scale):
        return module._run(weights, x, position_ids, seed, doc_ids, labels, loss_mask, tokens, grad_scale)

    return run
