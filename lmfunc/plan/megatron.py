"""Megatron-LM's theoretical numbers for a run, computed the way Megatron computes them.

``megatron/training/theoretical_memory_usage.py`` (parameters, weight-and-optimizer bytes, the two
activation formulas) and ``num_floating_point_operations`` in ``megatron/training/training.py``
(FLOPs per global batch, the MFU numerator). The arithmetic follows Megatron's, term by term and in
Megatron's order of float operations, so the printed values equal Megatron's for the same model
(``MegatronArgs.from_config`` translates an lmfunc ``TrainConfig``). Megatron's assumptions hold
here, not lmfunc's design: bf16 weights with fp32 master copies, gradients and Adam moments
(18 bytes per parameter, or ``6 + 12/dp`` with the distributed optimizer), activations per Korthikanti
et al. (arXiv 2205.05198, Table 2). lmfunc's own prediction is ``lmfunc.plan.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from lmfunc.config.model import ModelConfig
from lmfunc.config.train import DataConfig, RunConfig, TrainConfig

MB = 1024 * 1024
"""Megatron's 'MB' (NUM_BYTES_IN_MEGABYTE)."""


@dataclass(frozen=True)
class MegatronArgs:
    """The Megatron arguments the formulas read, named as in ``megatron/training/arguments.py``."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    padded_vocab_size: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    swiglu: bool
    normalization: str
    untie_embeddings_and_output_weights: bool
    add_bias_linear: bool
    mtp_num_layers: int
    sequence_parallel: bool
    recompute_granularity: Optional[str]
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    context_parallel_size: int
    expert_model_parallel_size: int
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    use_distributed_optimizer: bool = False
    """Megatron's --use-distributed-optimizer: lmfunc's layouts with dp_shard > 1 (the optimizer
    state sharded over the data-parallel ranks)."""

    @property
    def expert_tensor_parallel_size(self) -> int:
        """Megatron's default: the expert tensor-parallel size is the tensor-parallel size."""
        return self.tensor_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @classmethod
    def from_config(cls, cfg: TrainConfig, world_size: int) -> "MegatronArgs":
        """The Megatron arguments of ``cfg`` run on ``world_size`` processes (``cfg.run.global_batch_size``
        must be resolved: ``TrainConfig.validate`` does it)."""
        m, p = cfg.model, cfg.parallel
        sizes = p.sizes(world_size)
        recompute = None if m.recompute_granularity == "none" else m.recompute_granularity
        return cls(
            hidden_size=m.hidden_size, num_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            num_query_groups=m.query_groups, kv_channels=m.head_dim, ffn_hidden_size=m.ffn_size,
            padded_vocab_size=m.vocab_size, seq_length=cfg.data.seq_length, micro_batch_size=cfg.run.micro_batch_size,
            global_batch_size=cfg.run.global_batch_size, swiglu=m.activation == "swiglu",
            normalization=m.normalization, untie_embeddings_and_output_weights=not m.tie_embeddings,
            add_bias_linear=m.add_bias_linear, mtp_num_layers=m.mtp_num_layers,
            sequence_parallel=m.sequence_parallel and sizes["tp"] > 1, recompute_granularity=recompute,
            world_size=world_size, tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
            virtual_pipeline_model_parallel_size=p.virtual_stages, context_parallel_size=sizes["cp"],
            expert_model_parallel_size=p.ep, num_experts=m.num_experts,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size if m.moe_ffn_hidden_size is not None else m.ffn_size,
            moe_router_topk=m.moe_router_topk, moe_layer_freq=m.moe_layer_freq,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            multi_latent_attention=m.multi_latent_attention, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            use_distributed_optimizer=sizes["dp_shard"] * sizes["ep"] > 1,
        )


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts of ``compute_weight_and_optimizer_memory``."""

    transformer_block: float
    mtp_block: float
    embedding: float
    total: float
    active: float
    most_loaded_shard: float
    tp_sharded_on_most_loaded: float
    replicated_on_most_loaded: float
    expert_sharded_on_most_loaded: float
    other_shards: Optional[float]
    """Parameters on a pipeline stage without the embedding (pp > 1 only)."""


def _moe_pattern(a: MegatronArgs) -> list[int]:
    if a.num_experts is None:
        return [0] * a.num_layers
    if not isinstance(a.moe_layer_freq, int):
        return [int(flag) for flag in a.moe_layer_freq]
    return [1 if i % a.moe_layer_freq == 0 else 0 for i in range(a.num_layers)]


def parameter_counts(a: MegatronArgs) -> ParameterCounts:
    """Megatron's parameter counts: biases, learned position embeddings and the MTP projections and
    norms are not counted (Megatron leaves them out of the memory estimate)."""
    pattern = _moe_pattern(a)
    moe_layers = sum(pattern)
    dense_layers = a.num_layers - moe_layers
    mtp_moe = pattern[-1] * a.mtp_num_layers
    mtp_dense = (1 - pattern[-1]) * a.mtp_num_layers
    num_experts = 1 if a.num_experts is None else a.num_experts
    moe_ffn = a.moe_ffn_hidden_size if a.num_experts is not None else 0
    gated = 3 / 2 if a.swiglu else 1
    shared_ffn = a.moe_shared_expert_intermediate_size or 0
    norm_size = 1 if a.normalization == "RMSNorm" else 2
    h = a.hidden_size
    if a.multi_latent_attention:
        heads = a.num_attention_heads
        if a.q_lora_rank is None:
            q_term = h * heads * (a.qk_head_dim + a.qk_pos_emb_head_dim)
        else:
            q_term = a.q_lora_rank * (h + heads * (a.qk_head_dim + a.qk_pos_emb_head_dim) + norm_size)
        attention = (q_term + a.kv_lora_rank * (h + heads * (a.qk_head_dim + a.v_head_dim) + norm_size)
                     + h * a.qk_pos_emb_head_dim + (heads * a.v_head_dim) * h)
    else:
        q_ratio = a.kv_channels * a.num_attention_heads / h
        attention = 2 * h * h * ((1 + (a.num_query_groups / a.num_attention_heads)) * q_ratio)
    embedding = h * a.padded_vocab_size
    final_norm = norm_size * h
    embeddings = 2 * embedding if a.untie_embeddings_and_output_weights else embedding
    dense_mlp = 2 * h * a.ffn_hidden_size * gated
    shared = 2 * h * shared_ffn * gated
    routed = 2 * h * moe_ffn * num_experts * gated
    active_routed = 2 * h * moe_ffn * a.moe_router_topk * gated if a.num_experts is not None else 0
    norms = 2 * h * norm_size
    router = (h * num_experts + (num_experts if a.add_bias_linear else 0)) if a.num_experts is not None else 0
    dense_layer = attention + dense_mlp + norms
    moe_layer = attention + shared + routed + norms + router
    active_moe_layer = attention + shared + active_routed + norms + router
    block = dense_layer * dense_layers + moe_layer * moe_layers + final_norm
    active_block = dense_layer * dense_layers + active_moe_layer * moe_layers + final_norm
    mtp = dense_layer * mtp_dense + moe_layer * mtp_moe
    tp, pp, ep, etp = (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.expert_model_parallel_size,
                       a.expert_tensor_parallel_size)
    tp_block = (attention + dense_mlp) * dense_layers + (attention + shared) * moe_layers
    replicated_block = norms * dense_layers + (norms + router) * moe_layers + final_norm
    expert_block = routed * moe_layers
    tp_mtp = (attention + dense_mlp) * mtp_dense + (attention + shared) * mtp_moe
    replicated_mtp = norms * mtp_dense + (norms + router) * mtp_moe
    expert_mtp = routed * mtp_moe
    tp_sharded = ((tp_block / pp) + tp_mtp + embedding) / tp
    replicated = (replicated_block / pp) + replicated_mtp
    expert_sharded = ((expert_block / pp) + expert_mtp) / (etp * ep)
    most_loaded = tp_sharded + replicated + expert_sharded
    if a.untie_embeddings_and_output_weights and pp == 1:
        tp_sharded += embedding / tp
        most_loaded += embedding / tp
    other = (tp_block / (pp * tp) + replicated_block / pp + expert_block / (pp * etp * ep)) if pp > 1 else None
    return ParameterCounts(
        transformer_block=block, mtp_block=mtp, embedding=embeddings, total=block + mtp + embeddings,
        active=active_block + mtp + embeddings, most_loaded_shard=most_loaded, tp_sharded_on_most_loaded=tp_sharded,
        replicated_on_most_loaded=replicated, expert_sharded_on_most_loaded=expert_sharded, other_shards=other,
    )


def weight_and_optimizer_bytes(a: MegatronArgs, distributed_optimizer: bool) -> float:
    """Bytes of weights, gradients and optimizer state on the most-loaded rank: 18 per parameter, or
    ``6 + 12/dp`` with the distributed optimizer (experts divide by the expert-data-parallel size)."""
    counts = parameter_counts(a)
    expert_dp = a.world_size // (a.expert_tensor_parallel_size * a.expert_model_parallel_size
                                 * a.pipeline_model_parallel_size)

    def per_param(dp: int) -> float:
        return 18 if not distributed_optimizer else 6 + (12 / dp)

    return ((counts.tp_sharded_on_most_loaded + counts.replicated_on_most_loaded) * per_param(a.data_parallel_size)
            + counts.expert_sharded_on_most_loaded * per_param(expert_dp))


def _pipeline_factor(a: MegatronArgs, memory: float) -> float:
    pp, vpp = a.pipeline_model_parallel_size, a.virtual_pipeline_model_parallel_size
    if vpp is not None:
        memory *= 1 + ((pp - 1) / (pp * vpp))
    if vpp is None and pp > 1:
        memory *= min(1, a.num_microbatches / pp)
    return memory


def activation_bytes_sp(a: MegatronArgs) -> float:
    """Megatron's activation formula for sequence parallelism with selective recompute (the first
    pipeline stage, ``compute_activation_memory``)."""
    s, b, h, pp = a.seq_length, a.micro_batch_size, a.hidden_size, a.pipeline_model_parallel_size
    memory = (s * b * h) * (18 + (4 * (a.ffn_hidden_size / h)))
    memory *= a.num_layers
    memory += 8 * s * b * pp
    memory += s * b * h * pp
    memory = _pipeline_factor(a, memory)
    if pp == 1:
        memory += s * b * h * 4 * (1 + (a.padded_vocab_size / h))
    return memory / a.tensor_model_parallel_size


def activation_bytes_without_sp(a: MegatronArgs) -> float:
    """Megatron's activation formula for every other case (``compute_activation_memory_without_sp``),
    with its 5% allowance for temporaries."""
    s, b, h, pp, tp = (a.seq_length, a.micro_batch_size, a.hidden_size, a.pipeline_model_parallel_size,
                       a.tensor_model_parallel_size)
    memory = s * b * h * (10 + (24 / tp))
    memory *= a.num_layers
    memory += 8 * s * b * pp
    memory += s * b * h * pp
    memory = _pipeline_factor(a, memory)
    if pp == 1:
        logits = s * b * a.padded_vocab_size
        logits /= tp
        memory += (logits + s * b * h) * 2
    return memory * 1.05


def uses_sp_formula(a: MegatronArgs) -> bool:
    """Which activation formula Megatron reports: the SP one needs sequence parallelism and selective
    recompute."""
    return a.sequence_parallel and a.recompute_granularity == "selective"


def num_floating_point_operations(a: MegatronArgs, batch_size: int) -> float:
    """Training FLOPs of ``batch_size`` sequences of ``seq_length`` tokens (forward and backward:
    each GEMM three times, 2 FLOPs per multiply-add; causal attention counts half the scores)."""
    pattern = _moe_pattern(a)
    moe_layers = sum(pattern)
    dense_layers = a.num_layers - moe_layers
    routed_to = a.moe_router_topk if a.num_experts is not None else 0
    last_is_moe = pattern[-1] if a.num_experts is not None else 0
    mtp = a.mtp_num_layers
    moe_layers += last_is_moe * mtp
    dense_layers += (1 - last_is_moe) * mtp
    num_layers = a.num_layers + mtp
    moe_ffn = a.moe_ffn_hidden_size if a.moe_ffn_hidden_size is not None else a.ffn_hidden_size
    shared_ffn = a.moe_shared_expert_intermediate_size or 0
    fb, fma = 3, 2
    ffn_factor = 3 if a.swiglu else 2
    h, heads = a.hidden_size, a.num_attention_heads
    if a.multi_latent_attention:
        if a.q_lora_rank is None:
            q_term = h * heads * (a.qk_head_dim + a.qk_pos_emb_head_dim)
        else:
            q_term = a.q_lora_rank * (h + heads * (a.qk_head_dim + a.qk_pos_emb_head_dim) + 1)
        attn_linear = fb * fma * (q_term + a.kv_lora_rank * (h + heads * (a.qk_head_dim + a.v_head_dim) + 1)
                                  + h * a.qk_pos_emb_head_dim + (heads * a.v_head_dim) * h)
        attn_core = fb * fma * (heads * (a.qk_head_dim + a.qk_pos_emb_head_dim) / 2 + heads * a.v_head_dim / 2)
    else:
        q = a.kv_channels * heads
        kv = a.kv_channels * a.num_query_groups
        attn_linear = fb * fma * (h * (q + kv + kv) + q * h)
        attn_core = fb * fma * q / 2 * 2
    tokens = batch_size * a.seq_length
    squares = batch_size * a.seq_length * a.seq_length
    return (
        tokens * (
            fb * fma * h * ((a.ffn_hidden_size * ffn_factor) * dense_layers
                            + (moe_ffn * routed_to * ffn_factor) * moe_layers
                            + (shared_ffn * ffn_factor) * moe_layers)
            + attn_linear * num_layers
            + fb * fma * mtp * (3 * h + 2 * h * h)
            + fb * fma * h * a.padded_vocab_size * (mtp + 1)
        )
        + squares * attn_core * num_layers
    )


@dataclass(frozen=True)
class MegatronReport:
    """What Megatron prints for a run: parameters, the memory footprint and FLOPs per iteration."""

    args: MegatronArgs
    counts: ParameterCounts
    weight_and_optimizer: float
    weight_and_optimizer_distributed: float
    activations_sp: float
    activations_without_sp: float
    sp_formula: bool
    flops_per_iteration: float

    @property
    def activations(self) -> float:
        """The activation bytes Megatron reports (the formula that applies)."""
        return self.activations_sp if self.sp_formula else self.activations_without_sp

    def footprint_line(self) -> str:
        """Megatron's own line, ``Theoretical memory footprints: ...`` in its MB (with the
        distributed optimizer's weight and optimizer bytes when the run uses it, as Megatron prints)."""
        distributed = self.args.use_distributed_optimizer
        weights = (self.weight_and_optimizer_distributed if distributed else self.weight_and_optimizer) / MB
        activations = self.activations / MB
        return (f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
                f"activation={activations:.2f} MB, total={weights + activations:.2f} MB")


def megatron_report(a: MegatronArgs) -> MegatronReport:
    return MegatronReport(
        args=a, counts=parameter_counts(a), weight_and_optimizer=weight_and_optimizer_bytes(a, False),
        weight_and_optimizer_distributed=weight_and_optimizer_bytes(a, True), activations_sp=activation_bytes_sp(a),
        activations_without_sp=activation_bytes_without_sp(a), sp_formula=uses_sp_formula(a),
        flops_per_iteration=num_floating_point_operations(a, a.global_batch_size),
    )


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Megatron's training FLOPs per token of sequences of ``seq_length`` tokens (the MFU numerator)."""
    run = TrainConfig(model=cfg, data=DataConfig(seq_length=seq_length),
                      run=RunConfig(micro_batch_size=1, global_batch_size=1))
    return num_floating_point_operations(MegatronArgs.from_config(run, 1), 1) / seq_length


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_length: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s (Megatron's count) over ``peak_flops``."""
    return tokens_per_second * flops_per_token(cfg, seq_length) / peak_flops
