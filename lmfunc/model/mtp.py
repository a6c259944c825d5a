"""Multi-token prediction (DeepSeek-V3, Megatron's ``MultiTokenPredictionBlock``) as pure functions.

Depth k = 1..D combines the normed previous hidden state ``h^{k-1}`` (``h^0`` is the decoder
output after its final norm) with the normed embedding of the input shifted left by k, projects
the concatenation ``[2h] -> [h]``, runs one transformer layer (same causal/document mask and RoPE
tables as the main decoder) and normalises: ``h^k``. The shared output head turns ``h^k`` into
logits that predict token ``t + k + 1``; ``lmfunc.loss`` rolls the labels and the mask to match.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmfunc.config import ModelConfig
from lmfunc.model import gpt, layers
from lmfunc.model.moe import RouterStats
from lmfunc.model.recompute import checkpointed
from lmfunc.parallel import context
from lmfunc.parallel.context import is_context_parallel
from lmfunc.parallel.placement import compute_layout, gather, linear, region, residual_layout


def roll_left(x: torch.Tensor) -> torch.Tensor:
    """Shift ``x`` one position left along the last dim, filling the last position with 0
    (Megatron's ``roll_tensor``: ``torch.roll(x, -1, -1)`` with the wrapped value zeroed); a
    sequence split over ``cp`` is shifted in its original order (``lmfunc.parallel.context``)."""
    if is_context_parallel(x):
        return context.roll_left(x)
    return torch.cat([x[..., 1:], torch.zeros_like(x[..., :1])], dim=-1)


def forward(
    params: gpt.Params,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    cfg: ModelConfig,
    positions: Optional[torch.Tensor] = None,
    doc_ids: Optional[torch.Tensor] = None,
    dropout_seed: Optional[torch.Tensor] = None,
    aux_grad_scale: Optional[torch.Tensor] = None,
) -> tuple[list[torch.Tensor], list[RouterStats]]:
    """The MTP hidden states ``[h^1, ..., h^D]``, each ``[B, S, h]``, from the decoder output
    ``hidden`` ``[B, S, h]`` and its input ``tokens`` ``[B, S]`` (positions/doc_ids/aux_grad_scale
    as in ``gpt.decoder``), and the router statistics of the depths' MoE layers (empty when the
    depths are dense)."""
    positions, mask = layers.positions_and_mask(tokens, positions, doc_ids)
    rope = gpt.rope_for(positions, cfg)
    run_block = checkpointed(gpt.block) if cfg.recompute_granularity == "full" else gpt.block
    ids, pos, h = tokens, positions, hidden
    outputs, stats = [], []
    for k in range(cfg.mtp_num_layers):
        with region(f"mtp.{k}"):  # its parameters gathered in one collective when compiled
            p = params["mtp"][str(k)]
            ids, pos = roll_left(ids), roll_left(pos)
            stream = 8 * (cfg.num_layers + k + 1)
            sp = cfg.sequence_parallel
            e = residual_layout(gpt.embed_tokens(params, ids, pos, cfg), sp)
            e = layers.dropout(e, cfg.hidden_dropout, dropout_seed, stream + 3)
            both = [layers.norm(p["enorm"], e, cfg), layers.norm(p["hnorm"], residual_layout(h, sp), cfg)]
            x = linear(torch.cat(both, dim=-1), gather(p["eh_proj"]))
            x, layer_stats = run_block(p["layer"], x, cfg, rope, mask, dropout_seed, cfg.num_layers + k, aux_grad_scale)
            h = compute_layout(layers.norm(p["final_norm"], x, cfg))
        outputs.append(h)
        if layer_stats is not None:
            stats.append(layer_stats)
    return outputs, stats
