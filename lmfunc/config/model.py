"""Frozen configuration dataclasses and model presets.

Configs are plain frozen (hashable) dataclasses passed explicitly; ``torch.compile`` can
specialise on them. Field names follow Megatron-LM's arguments where one exists
(``num_query_groups``, ``rotary_percent``, ``init_method_std`` ...).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Literal, Optional


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """GPT-family decoder architecture."""

    vocab_size: int = 384
    """Rows of the token embedding (the padded vocabulary size)."""
    hidden_size: int = 256
    """Model width h."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Query heads a."""
    num_query_groups: Optional[int] = None
    """Key/value heads g (GQA); None means g = a (MHA); 1 is MQA."""
    kv_channels: Optional[int] = None
    """Per-head dimension d; None means hidden_size / num_attention_heads."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; None means 4h, or int(8h/3/64)*64 with SwiGLU (Megatron's rule)."""
    max_position_embeddings: int = 256
    """Longest sequence the model is built for (rows of the learned position table)."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """Rotary embeddings or a learned absolute position table."""
    rotary_base: float = 10000.0
    """RoPE base theta."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that are rotated (the rest pass through)."""
    seq_len_interpolation_factor: Optional[float] = None
    """Position interpolation: RoPE positions are divided by this factor."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm used before attention, before the MLP and after the last block."""
    norm_epsilon: float = 1e-5
    """Epsilon inside the norms."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP: SwiGLU (gate, up, down) or GeLU (fc1, fc2)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (same norm type as the blocks)."""
    add_bias_linear: bool = False
    """Biases in the attention and MLP projections."""
    tie_embeddings: bool = True
    """Use the token embedding as the output layer."""
    init_method_std: float = 0.02
    """Std of the normal init; block output projections use std / sqrt(2 * num_layers)."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each block's residual branches."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    sequence_parallel: bool = False
    """With tensor parallelism, keep the residual stream split along the sequence over tp (Megatron's
    --sequence-parallel): norms and dropout run on 1/tp of the tokens."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths D (DeepSeek-V3 / Megatron); depth k also predicts token t+k+1."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP losses: the objective gains (factor / D) x the sum of the per-depth losses."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recompute: 'selective' recomputes the attention core in the backward pass,
    'full' recomputes each whole transformer block (only its input is kept)."""
    scan_layers: bool = False
    """Store the transformer blocks' parameters stacked along a leading layer axis (``layers.attn.wq``
    is ``[L, h, a*d]``) and run the blocks with torch's ``scan``: the compiled step then holds one
    block's graph whatever num_layers is, so compiling takes about as long at 32 layers as at 4
    (MaxText's scan_layers). Same numbers as the unstacked model; one process only for now (torch's
    scan does not take DTensor parameters)."""
    num_experts: Optional[int] = None
    """Routed experts per MoE layer (Megatron's --num-experts). Planned by ``python -m lmfunc.plan``;
    not trainable yet."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each expert's MLP; None means model.ffn_hidden_size (Megatron's rule)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_layer_freq: int = 1
    """Layer i is an MoE layer when i % moe_layer_freq == 0 (Megatron's integer form)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared experts' MLP (None: no shared experts)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (DeepSeek's MLA). Planned by ``python -m lmfunc.plan``; not
    trainable yet."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query down-projection (None: queries are projected directly)."""
    kv_lora_rank: int = 512
    """MLA: rank of the compressed key/value latent."""
    qk_head_dim: int = 128
    """MLA: per-head query/key dimensions without RoPE."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head query/key dimensions with RoPE."""
    v_head_dim: int = 128
    """MLA: per-head value dimensions."""
    cross_entropy_chunk_tokens: int = 1024
    """Compute the output layer and its cross entropy this many tokens at a time, with their
    gradients, so no [tokens, vocab] logits buffer outlives its chunk (``lmfunc.loss.chunked_output``;
    vocabulary tiling). 0 computes all logits at once. Not used with tensor-parallel or FSDP
    (DTensor) heads, which take the plain path."""

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return int(8 * self.hidden_size / 3 / 64) * 64 or 64
        return 4 * self.hidden_size

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions per head (even)."""
        return int(self.head_dim * self.rotary_percent) // 2 * 2

    def __post_init__(self) -> None:
        validate_model(self)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_model(cfg: ModelConfig) -> None:
    """Raise ``ConfigError`` naming the field(s) and the fix when ``cfg`` is inconsistent."""
    _require(
        cfg.cross_entropy_chunk_tokens >= 0,
        f"model.cross_entropy_chunk_tokens must be >= 0 (0 = all tokens at once), got {cfg.cross_entropy_chunk_tokens}",
    )
    for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_position_embeddings"):
        value = getattr(cfg, name)
        _require(isinstance(value, int) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
    if cfg.kv_channels is None:
        _require(
            cfg.hidden_size % cfg.num_attention_heads == 0,
            f"model.hidden_size ({cfg.hidden_size}) is not divisible by model.num_attention_heads "
            f"({cfg.num_attention_heads}); change one of them or set model.kv_channels explicitly",
        )
    groups = cfg.query_groups
    _require(groups > 0, f"model.num_query_groups must be positive, got {cfg.num_query_groups}")
    _require(
        cfg.num_attention_heads % groups == 0,
        f"model.num_attention_heads ({cfg.num_attention_heads}) is not divisible by "
        f"model.num_query_groups ({groups}); pick a number of groups that divides the heads",
    )
    _require(0.0 < cfg.rotary_percent <= 1.0, f"model.rotary_percent must be in (0, 1], got {cfg.rotary_percent}")
    if cfg.position_embedding_type == "rope":
        _require(
            cfg.rotary_dim >= 2,
            f"model.rotary_percent ({cfg.rotary_percent}) x head dim ({cfg.head_dim}) leaves fewer than 2 "
            "rotary dimensions; raise rotary_percent",
        )
    _require(
        cfg.seq_len_interpolation_factor is None or cfg.seq_len_interpolation_factor > 0,
        f"model.seq_len_interpolation_factor must be positive, got {cfg.seq_len_interpolation_factor}",
    )
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(cfg, name)
        _require(0.0 <= value < 1.0, f"model.{name} must be in [0, 1), got {value}")
    _require(cfg.init_method_std > 0, f"model.init_method_std must be positive, got {cfg.init_method_std}")
    _require(cfg.ffn_size > 0, f"model.ffn_hidden_size must be positive, got {cfg.ffn_hidden_size}")
    _require(
        cfg.position_embedding_type in ("rope", "learned_absolute"),
        f"model.position_embedding_type must be 'rope' or 'learned_absolute', got {cfg.position_embedding_type!r}",
    )
    _require(
        cfg.normalization in ("RMSNorm", "LayerNorm"),
        f"model.normalization must be 'RMSNorm' or 'LayerNorm', got {cfg.normalization!r}",
    )
    _require(
        cfg.activation in ("swiglu", "gelu"), f"model.activation must be 'swiglu' or 'gelu', got {cfg.activation!r}"
    )
    _require(isinstance(cfg.mtp_num_layers, int) and cfg.mtp_num_layers >= 0,
             f"model.mtp_num_layers must be an integer >= 0, got {cfg.mtp_num_layers!r}")
    _require(cfg.mtp_loss_scaling_factor >= 0,
             f"model.mtp_loss_scaling_factor must be >= 0, got {cfg.mtp_loss_scaling_factor}")
    _require(cfg.num_experts is None or cfg.num_experts > 0, f"model.num_experts must be positive, got {cfg.num_experts}")
    _require(cfg.moe_router_topk > 0 and (cfg.num_experts is None or cfg.moe_router_topk <= cfg.num_experts),
             f"model.moe_router_topk ({cfg.moe_router_topk}) must be between 1 and model.num_experts ({cfg.num_experts})")
    _require(cfg.moe_layer_freq > 0, f"model.moe_layer_freq must be positive, got {cfg.moe_layer_freq}")
    _require(
        cfg.recompute_granularity in ("none", "selective", "full"),
        f"model.recompute_granularity must be 'none', 'selective' or 'full', got {cfg.recompute_granularity!r}",
    )


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Unit tests: runs in milliseconds.
    "tiny": ModelConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, max_position_embeddings=64,
    ),
    # The CPU default: trains on a byte-level vocabulary (256 bytes + specials, padded to 384) in minutes.
    "small": ModelConfig(
        vocab_size=384, hidden_size=256, num_layers=4, num_attention_heads=4,
        max_position_embeddings=256,
    ),
    # GPT-2 small (124M): learned positions, LayerNorm, GeLU, biases, tied head.
    "gpt2-small": ModelConfig(
        vocab_size=50304, hidden_size=768, num_layers=12, num_attention_heads=12,
        max_position_embeddings=1024, position_embedding_type="learned_absolute",
        normalization="LayerNorm", activation="gelu", add_bias_linear=True,
    ),
    # Llama-3.2-1B layout: GQA 32/8, SwiGLU 8192, RoPE base 500000, RMSNorm, tied head.
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, num_layers=16, num_attention_heads=32, num_query_groups=8,
        ffn_hidden_size=8192, max_position_embeddings=8192, rotary_base=500000.0,
    ),
}


def model_preset(name: str, **overrides: object) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied (validated)."""
    if name not in MODEL_PRESETS:
        close = difflib.get_close_matches(name, MODEL_PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown model preset {name!r}{hint} Known presets: {', '.join(MODEL_PRESETS)}")
    return dataclasses.replace(MODEL_PRESETS[name], **overrides)
