"""The parameters of each pipeline stage: subtrees of the model's pytree under their model-wide
names, so a stage's checkpoint shards line up with every other pp size's.

Stage ``s`` of a ``PipelineSplit`` (``lmfunc.config.pipeline``) holds ``layers.<i>`` for its
layers; the first stage also the embedding; the last stage the final norm, the untied output layer
and the MTP depths. The last stage also needs the token embedding when the output layer is tied to
it or when MTP runs (each depth embeds the shifted tokens): Megatron keeps a copy of the embedding
on the last stage and all-reduces its gradient over the "embedding group" (first and last stage).
``shared_leaves`` names those leaves; their gradients are summed across the stages holding them.
``stage_forward`` is a stage's part of ``gpt.forward``; ``stage_moe_layers`` says which MoE layers'
router statistics it produces.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmfunc.config.model import ModelConfig
from lmfunc.config.pipeline import PipelineSplit
from lmfunc.model import gpt, layers, moe
from lmfunc.model.moe import RouterStats
from lmfunc.tree import PyTree


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
                  dropout_seed: Optional[torch.Tensor] = None,
                  aux_grad_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[RouterStats]]:
    """Stage ``stage``'s part of ``gpt.forward`` over its ``stage_params``: ``x`` is the tokens
    ``[B, S]`` on the first stage and the previous stage's output ``[B, S, h]`` on the others; the
    result is ``[B, S, h]``, final-normed on the last stage, and the ``RouterStats`` of the stage's
    MoE layers in layer order (``aux_grad_scale`` as in ``gpt.decoder``). Every stage needs
    ``positions`` (RoPE) and ``doc_ids`` (the document mask); composed over the stages this is
    ``gpt.forward``. A sequence split over ``cp`` is in load-balanced order: ``positions`` ``[B, S]``
    (then given for every token, its original index by default) also tell attention where each
    token was."""
    positions, mask = layers.positions_and_mask(positions, positions, doc_ids)
    if split.holds_embedding(stage):
        x = gpt.embed_input(params, x, positions, cfg, dropout_seed)
    x, stats = gpt.run_layers(params, x, cfg, gpt.rope_for(positions, cfg), mask, dropout_seed, split.layers[stage],
                              aux_grad_scale)
    return (gpt.final_hidden(params, x, cfg) if split.holds_head(stage) else x), stats


def stage_moe_layers(cfg: ModelConfig, split: PipelineSplit, stage: int) -> list[int]:
    """The positions in ``moe.moe_layer_names(cfg)`` (the order of every MoE layer's ``RouterStats``)
    of the MoE layers stage ``stage`` runs: its layers', then on the last stage the MTP depths'."""
    names = moe.moe_layer_names(cfg)
    held = [f"layers.{i}.mlp" for i in split.layers[stage]]
    if split.holds_head(stage):
        held += [f"mtp.{k}.layer.mlp" for k in range(cfg.mtp_num_layers)]
    return [names.index(name) for name in held if name in names]


def rank_params(params: PyTree, cfg: ModelConfig, split: PipelineSplit, rank: int) -> PyTree:
    """The part of the full (unstacked) parameter tree that pipeline rank ``rank`` holds: the union
    of its stages' ``stage_params``."""
    merged: dict = {}
    for stage in split.stages_of_rank(rank):
        for key, value in stage_params(params, cfg, split, stage).items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return merged
