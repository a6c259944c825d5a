"""Language-model losses. Logits are upcast to fp32 inside the loss.

Losses return ``(sum_of_token_losses, num_tokens)`` rather than a mean, so that microbatches,
data-parallel ranks and (later) MTP depths can be summed first and divided once by the global
token count — Megatron's ``sum(loss * mask) / sum(mask)``.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from lmfunc import model
from lmfunc.config import ModelConfig
from lmfunc.model.layers import upcast


def masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of ``logits`` ``[..., V]`` against ``labels`` ``[...]`` weighted by ``loss_mask``.

    Returns ``(sum over tokens of mask * loss, sum of mask)`` as scalars; the mean is their
    ratio. Without a mask every token counts. Logits are upcast to at least fp32 first.
    """
    per_token = F.cross_entropy(upcast(logits).flatten(0, -2), labels.flatten(), reduction="none")
    if loss_mask is None:
        count = torch.tensor(float(per_token.numel()), dtype=per_token.dtype, device=per_token.device)
        return per_token.sum(), count
    mask = loss_mask.flatten().to(per_token.dtype)
    return (per_token * mask).sum(), mask.sum()


def lm_loss(
    params: model.gpt.Params,
    batch: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    dropout_seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of one batch: ``(sum_of_token_losses, num_tokens)``.

    ``batch`` holds ``tokens`` and ``labels`` ``[B, S]`` and optionally ``loss_mask``,
    ``position_ids`` and ``doc_ids`` ``[B, S]``.
    """
    hidden = model.forward(
        params, batch["tokens"], cfg,
        positions=batch.get("position_ids"), doc_ids=batch.get("doc_ids"), dropout_seed=dropout_seed,
    )
    return masked_cross_entropy(model.logits(params, hidden, cfg), batch["labels"], batch.get("loss_mask"))
