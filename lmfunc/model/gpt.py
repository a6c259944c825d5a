"""The GPT decoder as pure functions over a nested-dict parameter tree.

Tree layout (dotted names are stable; ``layers`` is keyed "0", "1", ...)::

    embed.tokens [V, h]            embed.positions [P, h]   (learned_absolute only)
    layers.<i>.attn_norm.{scale, bias}
    layers.<i>.attn.{wq [h, a*d], wk [h, g*d], wv [h, g*d], wo [a*d, h], bq, bk, bv, bo, q_norm, k_norm}
    layers.<i>.attn.{wq | wq_down, q_norm, wq_up; wkv_down, kv_norm, wkv_up; wo}   (MLA: lmfunc.model.mla)
    layers.<i>.mlp_norm.{scale, bias}
    layers.<i>.mlp.{w_gate, w_up [h, f] | w_in [h, f]; w_out [f, h]; b_*}
    layers.<i>.mlp.{router.{weight [h, E], expert_bias [E]}, experts.{w_gate, w_up [E, h, f], w_out [E, f, h]},
                    shared_experts.{w_gate, w_up [h, fs], w_out [fs, h]}}   (MoE layers, model.moe_layers)
    final_norm.{scale, bias}
    output [h, V]                  (untied only)
    mtp.<k>.{enorm, hnorm, eh_proj [2h, h], layer.<as layers.<i>>, final_norm}   (mtp_num_layers > 0)

With ``scan_layers`` the blocks' leaves are stacked instead: ``layers.attn.wq [L, h, a*d]`` and so
on, one leading axis (logical name "layers") over the blocks, and ``forward`` runs them with
torch's ``scan``. ``stack_layers``/``unstack_layers`` convert between the two trees.

One table (``param_specs``, in ``lmfunc.model.param_specs``, re-exported here) gives every
leaf's shape, logical axes and initialiser, so ``init`` and ``param_axes`` can never disagree. A leaf can be non-trainable state that travels with
the parameters (checkpoints, exports, evaluation): the routers' ``expert_bias``, which receives no
gradient and which the train step sets with ``moe.updated_expert_biases``.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from lmfunc.config import ModelConfig
from lmfunc.model import layers, mla, moe
from lmfunc.model.moe import RouterStats
from lmfunc.model.recompute import checkpointed
from lmfunc.parallel.placement import compute_layout, embedding_lookup, gather, linear, region, residual_layout
from lmfunc.tree import tree_map

from lmfunc.model.param_specs import (LAYER_AXIS, LeafSpec, Params, init, init_leaf, leaf_seed, param_axes,  # noqa: F401
                                      param_shapes, param_specs)


def _check_inputs(tokens: torch.Tensor, cfg: ModelConfig, positions, doc_ids) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if cfg.position_embedding_type == "learned_absolute" and tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds model.max_position_embeddings "
            f"({cfg.max_position_embeddings}) of the learned position table; shorten the sequence "
            "or raise max_position_embeddings"
        )
    for name, t in (("positions", positions), ("doc_ids", doc_ids)):
        if t is not None and t.shape[-1] != tokens.shape[1]:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but tokens have shape {tuple(tokens.shape)}")


def block(
    p: Params, x: torch.Tensor, cfg: ModelConfig, rope, mask,
    dropout_seed: Optional[torch.Tensor] = None, layer_index: Union[int, torch.Tensor] = 0,
    aux_grad_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[RouterStats]]:
    """One pre-norm transformer block ``[B, S, h] -> [B, S, h]``, and its router's statistics when
    its MLP is an MoE layer (None otherwise; ``aux_grad_scale`` as in ``decoder``). ``layer_index``
    (an int, or a 0-dim integer tensor under ``scan``) separates the block's dropout streams from
    the others'."""
    stream, sp = 8 * (layer_index + 1), cfg.sequence_parallel
    h = compute_layout(layers.norm(p["attn_norm"], x, cfg))
    project = mla.project_qkv if cfg.multi_latent_attention else None
    attn_out = residual_layout(layers.attention(p["attn"], h, cfg, rope, mask, dropout_seed, stream, project), sp)
    x = x + layers.dropout(attn_out, cfg.hidden_dropout, dropout_seed, stream + 1)
    h = compute_layout(layers.norm(p["mlp_norm"], x, cfg))
    mlp_out, stats = moe.feed_forward(p["mlp"], h, cfg, aux_grad_scale)
    mlp_out = residual_layout(mlp_out, sp)
    return x + layers.dropout(mlp_out, cfg.hidden_dropout, dropout_seed, stream + 2), stats


def embed_tokens(params: Params, tokens: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Token embeddings ``[B, S, h]``, plus learned position embeddings when the model has them."""
    x = embedding_lookup(tokens, gather(params["embed"]["tokens"]))
    if cfg.position_embedding_type == "rope":
        return x
    return x + F.embedding(positions, gather(params["embed"]["positions"]))


def rope_for(positions: torch.Tensor, cfg: ModelConfig) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """RoPE cos/sin tables for ``positions`` (None with learned positions)."""
    return layers.rope_tables(positions, cfg) if cfg.position_embedding_type == "rope" else None


def embed(
    params: Params, tokens: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """``embed_tokens`` and ``rope_for`` of the same positions."""
    return embed_tokens(params, tokens, positions, cfg), rope_for(positions, cfg)


class DecoderOutput(NamedTuple):
    """``decoder``'s result: the final-normed hidden states ``[B, S, h]`` and one ``RouterStats``
    per MoE layer, in layer order (empty for a dense model)."""

    hidden: torch.Tensor
    router_stats: list[RouterStats]


def decoder(
    params: Params,
    tokens: torch.Tensor,
    cfg: ModelConfig,
    positions: Optional[torch.Tensor] = None,
    doc_ids: Optional[torch.Tensor] = None,
    dropout_seed: Optional[torch.Tensor] = None,
    aux_grad_scale: Optional[torch.Tensor] = None,
) -> DecoderOutput:
    """The decoder on ``tokens`` ``[B, S]``: final-normed hidden states ``[B, S, h]`` and the MoE
    layers' router statistics.

    positions: ``[B, S]`` or ``[S]`` integer positions (default ``0..S-1``), e.g. restarted
        after each end-of-document token.
    doc_ids: ``[B, S]`` document ids; when given, attention is also block-diagonal over
        documents (a token only sees earlier tokens of its own document).
    dropout_seed: integer tensor; dropout (``hidden_dropout``/``attention_dropout``) is applied
        only when it is given, and is a pure function of it.
    aux_grad_scale: when given, each MoE layer's weighted router losses receive this gradient
        (``lmfunc.grad.attach_aux_loss``): the train step's scale of one unit of objective.
    """
    _check_inputs(tokens, cfg, positions, doc_ids)
    positions, mask = layers.positions_and_mask(tokens, positions, doc_ids)
    x = embed_input(params, tokens, positions, cfg, dropout_seed)
    with region("embed"):
        rope = rope_for(positions, cfg)
    if cfg.scan_layers:
        run_block = checkpointed(block) if cfg.recompute_granularity == "full" else block
        x, stats = _scan_blocks(run_block, params["layers"], x, cfg, rope, mask, dropout_seed), []
    else:
        x, stats = run_layers(params, x, cfg, rope, mask, dropout_seed, range(cfg.num_layers), aux_grad_scale)
    return DecoderOutput(final_hidden(params, x, cfg), stats)


def forward(
    params: Params,
    tokens: torch.Tensor,
    cfg: ModelConfig,
    positions: Optional[torch.Tensor] = None,
    doc_ids: Optional[torch.Tensor] = None,
    dropout_seed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Final-normed hidden states ``[B, S, h]`` for ``tokens`` ``[B, S]`` (``decoder``'s hidden
    states; arguments as there)."""
    return decoder(params, tokens, cfg, positions, doc_ids, dropout_seed).hidden


def embed_input(params: Params, tokens: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig,
                dropout_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The blocks' input ``[B, S, h]``: the embeddings of ``tokens`` ``[B, S]`` in the residual
    layout, with dropout (stream 1). The first part of ``forward`` (and of a first pipeline stage)."""
    with region("embed"):
        x = embed_tokens(params, tokens, positions, cfg)
    return layers.dropout(residual_layout(x, cfg.sequence_parallel), cfg.hidden_dropout, dropout_seed, 1)


def run_layers(params: Params, x: torch.Tensor, cfg: ModelConfig, rope, mask, dropout_seed: Optional[torch.Tensor],
               indices: Iterable[int], aux_grad_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[RouterStats]]:
    """The unstacked blocks ``layers.<i>`` for ``i`` in ``indices`` (model-wide indices: they name the
    leaves, the regions and the dropout streams), in order, recomputed with full recompute;
    ``[B, S, h] -> [B, S, h]``, and the router statistics of the MoE layers among them. A pipeline
    stage runs its own indices."""
    run_block = checkpointed(block) if cfg.recompute_granularity == "full" else block
    stats = []
    for i in indices:
        with region(f"layers.{i}"):
            x, layer_stats = run_block(params["layers"][str(i)], x, cfg, rope, mask, dropout_seed, i, aux_grad_scale)
        if layer_stats is not None:
            stats.append(layer_stats)
    return x, stats


def final_hidden(params: Params, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The final norm of the last block's output, in the compute layout: ``forward``'s result."""
    with region("head"):
        return compute_layout(layers.norm(params["final_norm"], x, cfg))


def _scan_blocks(run_block, stacked: Params, x: torch.Tensor, cfg: ModelConfig, rope, mask,
                 dropout_seed: Optional[torch.Tensor]) -> torch.Tensor:
    """``run_block`` over the stacked block leaves ``[L, ...]`` with torch's ``scan``: the same
    blocks as the unrolled loop (each block's dropout stream comes from its index, a scanned
    ``[L]`` tensor), traced once. Returns the last block's output ``[B, S, h]``."""
    from lmfunc.compiler.torch_compat.tensors import scan
    from lmfunc.compiler.torch_compat.tracing import scan_settings

    def body(carry: torch.Tensor, layer: tuple[Params, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        p, index = layer
        out, _ = run_block(p, carry, cfg, rope, mask, dropout_seed, index)
        return out, out.new_zeros(())

    indices = torch.arange(cfg.num_layers, device=x.device)
    with scan_settings():
        x, _ = scan(body, x, (stacked, indices))
    return x


def layer_params(params: Params, cfg: ModelConfig, i: int) -> Params:
    """Block ``i``'s parameter tree (a view into the stacked leaves with ``scan_layers``)."""
    return tree_map(lambda t: t[i], params["layers"]) if cfg.scan_layers else params["layers"][str(i)]


def stack_layers(params: Params) -> Params:
    """``params`` with ``layers.<i>.*`` leaves stacked into ``layers.*`` ``[L, ...]`` (the
    ``scan_layers`` layout); other leaves are shared, not copied."""
    blocks = params["layers"]
    return {**params, "layers": tree_map(lambda *leaves: torch.stack(leaves), *(blocks[str(i)] for i in range(len(blocks))))}


def unstack_layers(params: Params, num_layers: int) -> Params:
    """The inverse of ``stack_layers``: ``layers.*`` ``[L, ...]`` split into ``layers.<i>.*`` (views)."""
    return {**params, "layers": {str(i): tree_map(lambda t: t[i], params["layers"]) for i in range(num_layers)}}


def output_weight(params: Params, cfg: ModelConfig) -> torch.Tensor:
    """The ``[h, V]`` output projection (the transposed token embedding when tied)."""
    with region("head"):
        return gather(params["embed"]["tokens"]).t() if cfg.tie_embeddings else gather(params["output"])


def logits(params: Params, hidden: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Vocabulary logits ``[B, S, V]`` from final hidden states ``[B, S, h]``."""
    return linear(hidden, output_weight(params, cfg))
