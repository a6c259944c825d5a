"""Losses of the language model: the next-token loss (``next_token``), the output layer fused with
its cross entropy over token chunks (``chunked_output``); auxiliary losses (multi-token prediction
here, the MoE router's losses in the model) reach the gradient through ``lmfunc.grad.attach_aux_loss``."""

from lmfunc.grad import attach_aux_loss
from lmfunc.loss.chunked_output import IGNORE_INDEX, chunked_output_layer_loss
from lmfunc.loss.next_token import (
    LossOutput,
    lm_loss,
    lm_loss_of_hidden,
    lm_loss_sum,
    masked_cross_entropy,
    mtp_aux_loss,
    output_layer_loss,
)

__all__ = [
    "IGNORE_INDEX", "LossOutput", "attach_aux_loss", "chunked_output_layer_loss", "lm_loss", "lm_loss_of_hidden",
    "lm_loss_sum",
    "masked_cross_entropy", "mtp_aux_loss", "output_layer_loss",
]
