"""``attach_aux_loss``: hang an auxiliary loss (MTP, MoE load balancing) onto the main graph.

Megatron's ``MTPLossAutoScaler``: the forward returns ``x`` unchanged; the backward passes ``x``'s
gradient through and gives ``aux_loss`` the gradient ``scale``, as if ``scale * aux_loss`` had been
added to the objective. The scale is a tensor (the loss scale times the microbatch or token
normalisation), so changing it never recompiles. Written in the ``setup_context`` style with
``generate_vmap_rule``, the form that works under ``torch.func``, ``autograd.grad`` and
``torch.compile(fullgraph=True)`` alike (``tests/test_mtp.py`` compiles it with ``autograd.grad``).
"""

from __future__ import annotations

from typing import Any, Union

import torch


class _AttachAuxLoss(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, aux_loss, scale = inputs
        ctx.save_for_backward(scale)
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor):
        (scale,) = ctx.saved_tensors
        grad_aux = torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_x.device) * scale.to(ctx.aux_dtype)
        return grad_x, grad_aux, None


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, scale: Union[torch.Tensor, float] = 1.0) -> torch.Tensor:
    """``x`` unchanged; in the backward ``aux_loss`` receives the gradient ``scale`` (elementwise).

    ``x``: any tensor on the path to the main loss (Megatron uses the final hidden states).
    ``aux_loss``: a tensor (usually a scalar) that depends on the parameters.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=aux_loss.device)
    return _AttachAuxLoss.apply(x, aux_loss, scale)
