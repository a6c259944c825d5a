"""Throughput accounting with Megatron's formulas (``num_floating_point_operations``).

FLOPs count a forward and backward pass (3x the forward's matmul FLOPs, 2 per multiply-add);
attention's core is counted causally (half of the S x S scores), as Megatron does.
"""

from __future__ import annotations

from lmfunc.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_length: int) -> int:
    """Training FLOPs per token of a dense GPT (forward + backward), Megatron's formula.

    ``6 h f c L + 6 (h (q + 2 d g) + q h) L + 6 h V + 6 q s L`` with q = a d, c = 3 for SwiGLU
    (gate, up, down) or 2 for GeLU. ``V`` is the embedding rows (the padded vocabulary).
    """
    h, layers, d = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    q = cfg.num_attention_heads * d
    mlp_matrices = 3 if cfg.activation == "swiglu" else 2
    mlp = 6 * h * cfg.ffn_size * mlp_matrices * layers
    attention_linear = 6 * (h * (q + 2 * d * cfg.query_groups) + q * h) * layers
    attention_core = 6 * q * seq_length * layers
    logits = 6 * h * cfg.vocab_size
    return mlp + attention_linear + attention_core + logits


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_length: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over ``peak_flops``."""
    return tokens_per_second * flops_per_token(cfg, seq_length) / peak_flops
