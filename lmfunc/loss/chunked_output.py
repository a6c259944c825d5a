"""The output layer and its cross entropy, fused over chunks of tokens (vocabulary tiling).

The plain head computes ``logits = hidden @ W`` for every token at once and keeps a full
``[tokens, V]`` buffer alive into the backward, and the backward adds a second one for its
gradient: with the default vocabulary that pair is the largest single item of a step's memory
(MaxText's ``num_vocab_tiling``, Liger's fused linear cross entropy and Megatron's cross-entropy
fusion attack the same buffers). ``chunked_output_layer_loss`` walks the tokens in chunks of ``chunk``:
each chunk's logits, log-sum-exp, loss and logits gradient ``softmax - onehot`` exist only while
that chunk is processed, and the chunk's contributions to the gradients of ``hidden`` and ``W``
are computed right there. What is kept for the backward is those two gradients (the size of
``hidden`` and of ``W``); the backward only scales them by the incoming gradient. The result is
the same function: forward value and gradients equal the plain head's up to float summation
order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lmfunc.model.layers import upcast

IGNORE_INDEX = -100


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    """One chunk: ``(sum of mask * token loss, logits in >= fp32, log-sum-exp)`` for hidden ``[C, h]``."""
    logits = upcast(hidden @ weight)
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return ((lse - target) * mask).sum(), logits, lse


def _logits_gradient(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """``(softmax(logits) - onehot(labels)) * row_scale[:, None]`` for logits ``[C, V]``, written into ``logits``.

    The one-hot term touches one entry per row, so it is subtracted at the label positions instead
    of being built as a ``[C, V]`` tensor; the chunk's logits are not needed afterwards, so the
    softmax reuses their buffer (no ``[C, V]`` temporaries when run eagerly).
    """
    grad = logits.sub_(lse[:, None]).exp_().mul_(row_scale[:, None])
    rows = torch.arange(grad.shape[0], device=grad.device)
    return grad.index_put_((rows, labels.clamp(min=0)), -row_scale.to(grad.dtype), accumulate=True)


def _valid_mask(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mask * (labels != IGNORE_INDEX).to(mask.dtype)


class _ChunkedOutputLayerLoss(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, grad_hint: torch.Tensor,
        chunk: int,
    ):
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)
        loss = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        grad_hidden = []
        grad_weight = torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            m = _valid_mask(y, mask[start:start + chunk])
            chunk_loss, logits, lse = _chunk_loss(h, weight, y, m)
            loss = loss + chunk_loss
            grad_logits = _logits_gradient(logits, lse, y, m * grad_hint).to(hidden.dtype)
            grad_hidden.append(grad_logits @ weight.t())
            grad_weight = grad_weight + upcast(h.t() @ grad_logits)
        return loss, torch.cat(grad_hidden), grad_weight.to(weight.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        _, grad_hidden, grad_weight = output
        ctx.save_for_backward(grad_hidden, grad_weight, inputs[4])
        ctx.mark_non_differentiable(grad_hidden, grad_weight)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_hidden: Any, _grad_weight: Any):
        grad_hidden, grad_weight, grad_hint = ctx.saved_tensors
        factor = grad_loss / grad_hint  # exactly 1 when the hint was the incoming gradient
        return grad_hidden * factor.to(grad_hidden.dtype), grad_weight * factor.to(grad_weight.dtype), None, None, None, None


def chunked_output_layer_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor], chunk: int,
    grad_hint: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_cross_entropy(hidden @ weight, labels, loss_mask)`` computed ``chunk`` tokens at a time.

    hidden ``[..., h]`` and weight ``[h, V]`` in the compute dtype; labels and loss_mask ``[...]``
    (labels equal to -100 count as masked, as in ``F.cross_entropy``). Returns ``(sum over tokens
    of mask * loss, sum of mask)`` as scalars in at least fp32, the dtype of the logits inside the loss. When a
    gradient is needed it is computed chunk by chunk in the forward (see the module docstring).

    grad_hint: the gradient the loss will receive (the step's loss scale times its normalisation).
        The gradients are computed already multiplied by it, so in fp16/bf16 they have the range
        they would have had in the plain backward (loss scaling keeps working); the backward then
        multiplies by ``incoming / grad_hint``, which is 1 when the hint was right. Any positive
        value gives the same gradients up to rounding; default 1, which also stands in for 0.
    """
    loss_dtype = torch.promote_types(hidden.dtype, torch.float32)
    if chunk <= 0:
        raise ValueError(f"chunked_output_layer_loss: chunk must be a positive number of tokens, got {chunk}")
    hidden2d, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if loss_mask is None:
        mask = torch.ones(flat_labels.shape, dtype=loss_dtype, device=hidden.device)
        count = torch.tensor(float(flat_labels.numel()), dtype=loss_dtype, device=hidden.device)
    else:
        mask = loss_mask.reshape(-1).to(loss_dtype)
        count = mask.sum()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        one = torch.ones((), dtype=loss_dtype, device=hidden.device)
        # A zero hint (a loss weighted by 0, such as mtp_loss_scaling_factor 0) would divide the
        # backward by 0; any positive hint gives the same gradients, so 1 stands in for it.
        hint = one if grad_hint is None else torch.where(grad_hint == 0, one, grad_hint.to(loss_dtype))
        loss, _, _ = _ChunkedOutputLayerLoss.apply(hidden2d, weight, flat_labels, mask, hint, chunk)
        return loss, count
    loss = torch.zeros((), dtype=loss_dtype, device=hidden.device)
    for start in range(0, hidden2d.shape[0], chunk):
        y = flat_labels[start:start + chunk]
        chunk_loss, _, _ = _chunk_loss(hidden2d[start:start + chunk], weight, y, _valid_mask(y, mask[start:start + chunk]))
        loss = loss + chunk_loss
    return loss, count
