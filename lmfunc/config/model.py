"""Frozen configuration dataclasses and model presets.

Configs are plain frozen (hashable) dataclasses passed explicitly; ``torch.compile`` can
specialise on them. Field names follow Megatron-LM's arguments where one exists
(``num_query_groups``, ``rotary_percent``, ``init_method_std`` ...).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Literal, Optional, Union


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
    """Routed experts per MoE layer (Megatron's --num-experts); None is a dense model. The MoE
    layers replace the MLP with a router and SwiGLU experts (``lmfunc.model.moe``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each expert's MLP; None means model.ffn_hidden_size (Megatron's rule)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    """Which layers are MoE layers (Megatron's --moe-layer-freq): an int N makes layer i one when
    i % N == 0; a 0/1 pattern with one entry per layer names them (0 1 1 1: DeepSeek's dense first
    layer). Multi-token-prediction layers follow the last layer."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared experts' MLP, which every token passes through beside its routed
    experts (None: no shared experts)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (weights not renormalised over the chosen k)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the routing weights (DeepSeek-V3: 2.5)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: the experts form this many equal groups (DeepSeek's node-limited routing)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: a token's experts come from its best this-many groups."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3's aux-loss-free balancing: a per-expert bias (non-trainable, updated once per step
    by moe_router_bias_update_rate x sign(mean load - load)) added to the sigmoid scores for the
    choice of experts only."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Load-balancing loss: over the microbatch's tokens (Switch/GShard), per sequence (DeepSeek-V3),
    or none. Weighted by moe_aux_loss_coeff."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: not in the objective; Megatron's default)."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (None: none)."""
    moe_expert_capacity_factor: Optional[float] = None
    """Token dropping: each expert takes at most ceil(tokens x topk / experts x factor) pairs of a
    microbatch and drops the rest (static shapes). None is dropless."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """With a capacity factor, which pairs an expert keeps: its highest-weighted ("probs") or its
    earliest tokens ("position")."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (DeepSeek's MLA, ``lmfunc.model.mla``): keys and values from a
    normed latent of kv_lora_rank per token plus one RoPE key shared by the heads; generation caches
    only those. Replaces num_query_groups, kv_channels and rotary_percent."""
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
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each of the num_layers layers is an MoE layer (all False without experts)."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return tuple(i % self.moe_layer_freq == 0 for i in range(self.num_layers))
        return tuple(bool(flag) for flag in self.moe_layer_freq)

    @property
    def expert_ffn_size(self) -> int:
        """Width of one routed expert's MLP."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions per head (even): qk_pos_emb_head_dim with MLA."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
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
    _validate_moe(cfg)
    if cfg.multi_latent_attention:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(cfg, name)
            _require(isinstance(value, int) and value > 0, f"model.{name} must be a positive integer, got {value!r}")
        _require(cfg.qk_pos_emb_head_dim % 2 == 0,
                 f"model.qk_pos_emb_head_dim must be even (RoPE rotates pairs), got {cfg.qk_pos_emb_head_dim}")
        _require(cfg.q_lora_rank is None or cfg.q_lora_rank > 0,
                 f"model.q_lora_rank must be positive (None: queries projected directly), got {cfg.q_lora_rank}")
    _require(
        cfg.recompute_granularity in ("none", "selective", "full"),
        f"model.recompute_granularity must be 'none', 'selective' or 'full', got {cfg.recompute_granularity!r}",
    )


def _validate_moe(cfg: ModelConfig) -> None:
    """The mixture-of-experts fields (``validate_model``'s part)."""
    _require(cfg.num_experts is None or cfg.num_experts > 0, f"model.num_experts must be positive, got {cfg.num_experts}")
    _require(cfg.moe_router_topk > 0 and (cfg.num_experts is None or cfg.moe_router_topk <= cfg.num_experts),
             f"model.moe_router_topk ({cfg.moe_router_topk}) must be between 1 and model.num_experts ({cfg.num_experts})")
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        _require(freq > 0, f"model.moe_layer_freq must be positive, got {freq}")
    else:
        _require(len(freq) == cfg.num_layers and all(flag in (0, 1) for flag in freq),
                 f"model.moe_layer_freq {list(freq)} must be an integer or one 0/1 per layer "
                 f"(model.num_layers = {cfg.num_layers}), 1 marking an MoE layer")
    if cfg.num_experts is None:
        return
    _require(cfg.expert_ffn_size > 0, f"model.moe_ffn_hidden_size must be positive, got {cfg.moe_ffn_hidden_size}")
    _require(cfg.moe_shared_expert_intermediate_size is None or cfg.moe_shared_expert_intermediate_size > 0,
             f"model.moe_shared_expert_intermediate_size must be positive, got {cfg.moe_shared_expert_intermediate_size}")
    _require(cfg.moe_router_score_function in ("softmax", "sigmoid"),
             f"model.moe_router_score_function must be 'softmax' or 'sigmoid', got {cfg.moe_router_score_function!r}")
    _require(not cfg.moe_router_enable_expert_bias or cfg.moe_router_score_function == "sigmoid",
             "model.moe_router_enable_expert_bias steers sigmoid scores (DeepSeek-V3); set "
             "--model.moe-router-score-function sigmoid")
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    _require((groups is None) == (group_topk is None),
             "model.moe_router_num_groups and model.moe_router_group_topk go together: set both or neither")
    if groups is not None:
        _require(groups > 0 and cfg.num_experts % groups == 0 and 0 < group_topk <= groups
                 and cfg.moe_router_topk % group_topk == 0,
                 f"group-limited routing needs model.num_experts ({cfg.num_experts}) divisible by "
                 f"model.moe_router_num_groups ({groups}), and model.moe_router_group_topk ({group_topk}) at most "
                 f"the groups and dividing model.moe_router_topk ({cfg.moe_router_topk})")
    _require(cfg.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss", "none"),
             "model.moe_router_load_balancing_type must be 'aux_loss', 'seq_aux_loss' or 'none', got "
             f"{cfg.moe_router_load_balancing_type!r}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(cfg, name)
        _require(value is None or value >= 0, f"model.{name} must be >= 0, got {value}")
    _require(cfg.moe_expert_capacity_factor is None or cfg.moe_expert_capacity_factor > 0,
             f"model.moe_expert_capacity_factor must be positive (None: dropless), got {cfg.moe_expert_capacity_factor}")
    _require(cfg.moe_token_drop_policy in ("probs", "position"),
             f"model.moe_token_drop_policy must be 'probs' or 'position', got {cfg.moe_token_drop_policy!r}")


def unbuildable_features(cfg: ModelConfig) -> list[str]:
    """The MoE and MLA settings that Megatron has (and ``lmfunc.plan`` plans) but lmfunc's model
    does not build, each named with its fix."""
    found = []
    if cfg.multi_latent_attention:
        for failed, message in (
            (cfg.position_embedding_type != "rope", "model.position_embedding_type learned_absolute with MLA (its "
                                                    "decoupled keys are RoPE keys: --model.position-embedding-type rope)"),
            (cfg.qk_layernorm, "model.qk_layernorm with MLA (MLA normalises its latents; turn it off)"),
            (cfg.add_bias_linear, "model.add_bias_linear with MLA (its projections have no biases: "
                                  "--model.no-add-bias-linear)"),
        ):
            if failed:
                found.append(message)
    if cfg.num_experts is None:
        return found
    if cfg.activation != "swiglu":
        found.append(f"model.activation = {cfg.activation!r} with MoE (lmfunc's experts are SwiGLU: --model.activation swiglu)")
    if cfg.add_bias_linear:
        found.append("model.add_bias_linear with MoE (lmfunc's router and experts have no biases: "
                     "--model.no-add-bias-linear)")
    if cfg.scan_layers:
        found.append("model.scan_layers with MoE (the scanned blocks do not return the routers' statistics: "
                     "--model.no-scan-layers)")
    return found


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
    # Qwen3-MoE / Mixtral style at the CPU default's scale: GQA 4/2 with QK-norm, every layer 8 SwiGLU
    # experts with softmax top-2 routing (about the dense "small" model's active MLP parameters),
    # load-balancing and z-losses; dropless.
    "moe-small": ModelConfig(
        vocab_size=384, hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=2,
        qk_layernorm=True, max_position_embeddings=256, num_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=256, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
    ),
    # DeepSeek-V3's architecture at the CPU default's scale: multi-head latent attention (query and
    # key/value latents, decoupled RoPE keys), a dense first layer, then MoE layers of 8 routed
    # experts (sigmoid top-2 within the best 2 of 4 groups, weights x 2.5, aux-loss-free bias,
    # a small sequence-level balance loss) beside one shared expert, one MTP depth, untied head.
    "deepseek-v3-tiny": ModelConfig(
        vocab_size=384, hidden_size=256, num_layers=4, num_attention_heads=4, max_position_embeddings=256,
        ffn_hidden_size=640, tie_embeddings=False, multi_latent_attention=True, q_lora_rank=96,
        kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32,
        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128,
        moe_layer_freq=(0, 1, 1, 1), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, mtp_num_layers=1,
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
