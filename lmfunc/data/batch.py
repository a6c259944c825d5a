"""Language-model batches from token samples, with Megatron's ``get_ltor_masks_and_position_ids`` rules."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch


def lm_batch(
    samples: Union[np.ndarray, torch.Tensor],
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    pad: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """A batch from samples ``[..., S+1]``: ``tokens``, ``labels``, ``loss_mask`` ``[..., S]``.

    loss_mask is 1, and 0 where the *input* token is EOD (with ``eod_mask_loss``) or the label is
    ``pad``. With ``reset_position_ids`` the batch gets ``position_ids`` that restart after each EOD
    (without it the model uses ``0..S-1``); with
    ``reset_attention_mask`` the batch also gets ``doc_ids`` (the EOD stays in its document), from
    which the model builds a block-diagonal causal mask.
    """
    text = torch.as_tensor(samples, dtype=torch.int64)
    tokens, labels = text[..., :-1], text[..., 1:]
    seq = tokens.shape[-1]
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask = loss_mask.masked_fill(tokens == eod, 0.0)
    if pad is not None:
        loss_mask = loss_mask.masked_fill(labels == pad, 0.0)
    index = torch.arange(seq).expand_as(tokens)
    starts_doc = torch.zeros(tokens.shape, dtype=torch.bool)
    starts_doc[..., 1:] = tokens[..., :-1] == eod
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    if reset_position_ids:
        doc_start = torch.cummax(torch.where(starts_doc, index, torch.zeros_like(index)), dim=-1).values
        batch["position_ids"] = index - doc_start
    if reset_attention_mask:
        batch["doc_ids"] = torch.cumsum(starts_doc.to(torch.int64), dim=-1)
    return batch
