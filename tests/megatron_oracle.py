"""megatron-core as the tests' oracle: its ``GPTModel`` built on the CPU from an lmfunc
``ModelConfig``, under a one-rank gloo process group (an in-process store, no port).

megatron-core targets CUDA; three calls need the CPU here, and ``megatron_on_cpu`` patches them for
the duration: RoPE moves its frequencies to ``torch.cuda.current_device()``, attention dropout
enters the CUDA RNG tracker's ``fork()``, and the checkpoint writer calls
``torch.cuda.synchronize()``. Two more take Transformer Engine for present when it is only
partly importable: MLA checks ``isinstance(..., TELinear)`` and the router's gating calls TE's
GEMM; both are told TE is absent. MLA's local layer spec also builds a ``DotProductAttention``
with arguments it does not take (megatron-core 0.16), so ``megatron_gpt`` gives MLA layers
``CoreAttention``: parameter-free causal attention at MLA's softmax scale. Only tests use this
module; lmfunc never imports megatron-core.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist

from lmfunc.config.model import ModelConfig

megatron = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]'); the Megatron oracle tests need it")


class _NoCudaStream:
    """The current CUDA stream's waits as no-ops: on the CPU every operation has finished."""

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass


class _NoCudaRngTracker:
    """The CUDA RNG tracker's ``fork()`` as a no-op: dropout draws from the CPU generator."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def megatron_on_cpu(tp: int = 1, pp: int = 1, ep: int = 1) -> Iterator[None]:
    """megatron-core's model-parallel state on a one-rank gloo group (created here unless one
    exists) with the CUDA-only calls patched (module docstring); everything undone on exit."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import dot_product_attention, multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    patches = pytest.MonkeyPatch()
    patches.setattr(torch.cuda, "current_device", lambda: "cpu")
    patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    patches.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *args, **kwargs: _NoCudaRngTracker())
    patches.setattr(dot_product_attention.tensor_parallel, "get_cuda_rng_tracker",
                    lambda *args, **kwargs: _NoCudaRngTracker())
    patches.setattr(multi_latent_attention, "HAVE_TE", False)
    patches.setattr(moe_utils, "te_general_gemm", None, raising=False)
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    try:
        yield
    finally:
        _close_checkpoint_writer()
        parallel_state.destroy_model_parallel()
        patches.undo()
        if created:
            dist.destroy_process_group()


def _close_checkpoint_writer() -> None:
    """Shut down the process megatron-core's ``torch_dist`` writer started: its results queue is a
    multiprocessing ``Manager`` queue, kept in a module global, and its server process would
    outlive a worker that exits through ``os._exit``, holding the launcher's output pipes open.
    Dropping the queue drops the last reference to its manager, whose finalizer stops the server."""
    import gc

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        filesystem_async._results_queue = None
        gc.collect()


class CoreAttention(torch.nn.Module):
    """Causal softmax attention ``[S, B, n, d]`` -> ``[S, B, n d_v]`` at the given scale, for MLA
    layers (module docstring); parameter-free, so every weight still is megatron-core's."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        seq, batch = query.shape[:2]
        out = torch.nn.functional.scaled_dot_product_attention(
            *(t.permute(1, 2, 0, 3) for t in (query, key, value)), is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def megatron_gpt(cfg: ModelConfig, pre_process: bool = True, post_process: bool = True):
    """megatron-core's ``GPTModel`` (local layer spec, fp32, CPU, no dropout) with ``cfg``'s
    architecture, MoE, MLA and MTP layers included; call inside ``megatron_on_cpu``.
    ``pre_process``/``post_process``: whether this pipeline stage holds the embedding / the output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from lmfunc.checkpoint.megatron_args import _MOE_FIELDS

    swiglu = cfg.activation == "swiglu"
    settings = dict(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(), pipeline_dtype=torch.float32,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.ffn_size,
        gated_linear_unit=swiglu, activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_bias_linear, qk_layernorm=cfg.qk_layernorm or cfg.multi_latent_attention,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, mtp_num_layers=cfg.mtp_num_layers or None,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor)
    if cfg.num_experts is not None:
        settings |= dict(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.expert_ffn_size,
                         moe_layer_freq=1 if all(cfg.moe_layers) else list(map(int, cfg.moe_layers)),
                         moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
                         **{name: getattr(cfg, name) for name in _MOE_FIELDS})
    config_class = TransformerConfig
    if cfg.multi_latent_attention:
        config_class = MLATransformerConfig
        settings |= dict(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                         qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
                         v_head_dim=cfg.v_head_dim, rope_type="rope", rotary_base=int(cfg.rotary_base))
    config = config_class(**settings)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=cfg.normalization)
    if cfg.multi_latent_attention:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = CoreAttention
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if cfg.mtp_num_layers else None
    return GPTModel(config, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                    position_embedding_type="rope" if cfg.position_embedding_type == "rope" else "learned_absolute",
                    rotary_percent=cfg.rotary_percent, rotary_base=int(cfg.rotary_base),
                    share_embeddings_and_output_weights=cfg.tie_embeddings, pre_process=pre_process,
                    post_process=post_process, mtp_block_spec=mtp)


def megatron_logits(gpt, tokens: torch.Tensor) -> torch.Tensor:
    """``gpt``'s logits ``[B, S, V]`` for ``tokens`` ``[B, S]`` (causal mask, positions 0..S-1)."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return gpt(tokens, positions, mask)


def megatron_token_losses(gpt, tokens: torch.Tensor, labels: torch.Tensor,
                          loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gpt``'s per-token cross entropy ``[B, S]`` of ``labels`` after ``tokens`` ``[B, S]`` (causal
    mask, positions 0..S-1); a model with MTP layers needs labels to run forward at all, and takes
    ``loss_mask`` for its MTP losses (None: every token)."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return gpt(tokens, positions, mask, labels=labels, loss_mask=loss_mask)


@contextlib.contextmanager
def megatron_optimizer_on_cpu() -> Iterator[None]:
    """megatron-core's optimizers (plain and distributed) on the CPU while this holds: its modules
    make a few small tensors with ``device="cuda"`` (the loss-scale placeholder, the grad-norm
    buffers, the dynamic loss scaler's numbers), which are made on the CPU instead, and its gradient
    buffers (0.19) wait on the current CUDA stream, whose waits do nothing here. Clipping asserts
    CUDA gradients: build the optimizer with ``clip_grad=0``."""
    import types

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer

    def on_cpu(make):
        return lambda *args, device=None, **kwargs: make(*args, device="cpu" if device == "cuda" else device, **kwargs)

    shim = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(shim, name, on_cpu(getattr(torch, name)))
    patches = pytest.MonkeyPatch()
    for module in (utils, clip_grads, optimizer, grad_scaler, distrib_optimizer):
        patches.setattr(module, "torch", shim)
    patches.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: _NoCudaStream())
    try:
        yield
    finally:
        patches.undo()


def megatron_adam(gpt, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                  dtype: torch.dtype = torch.float32, distributed: bool = False, **loss_scaling):
    """``(ddp, optimizer)``: megatron-core's DDP wrapper of ``gpt`` and its Adam (no clipping, the
    plain optimizer), inside ``megatron_on_cpu`` and ``megatron_optimizer_on_cpu``. A step:
    ``ddp.zero_grad_buffer()``, the backward of the loss times ``optimizer.get_loss_scale()``,
    ``ddp.finish_grad_sync()``, ``optimizer.step()``. Each parameter group's weight decay is
    ``weight_decay`` times its ``wd_mult`` (0 for norms and biases), as Megatron-LM's
    ``OptimizerParamScheduler`` sets it before every step.

    ``dtype`` fp16 or bf16: Megatron-LM's mixed precision, ``--fp16``/``--bf16`` with
    ``--accumulate-allreduce-grads-in-fp32``: the model in ``Float16Module`` (its params in
    ``dtype``, fp32 logits), the gradients summed in fp32, and the mixed-precision optimizer with fp32
    master weights (``Float16OptimizerWithFloat16Params``), for fp16 with the dynamic loss scaler
    ``loss_scaling`` configures (``OptimizerConfig``'s ``initial_loss_scale``, ``loss_scale_window``,
    ``hysteresis``, ``min_loss_scale``). ``distributed``: the distributed optimizer instead
    (``--use-distributed-optimizer``, here over one data-parallel rank). Those optimizers accept
    only CUDA tensors by their type name, so CPU tensors report CUDA's while they are built."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    mixed = dtype != torch.float32
    model = gpt
    if mixed:
        gpt.config.fp16, gpt.config.bf16 = dtype == torch.float16, dtype == torch.bfloat16
        model = Float16Module(gpt.config, gpt)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=mixed or distributed,
                                               use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(gpt.config, ddp_config, model)
    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
                             adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0, fp16=dtype == torch.float16,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=distributed,
                             **loss_scaling)
    with pytest.MonkeyPatch.context() as patches:
        if mixed or distributed:
            cpu_type = torch.Tensor.type

            def cuda_type(tensor, *args, **kwargs):
                name = cpu_type(tensor, *args, **kwargs)
                return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and ".cuda." not in name else name

            patches.setattr(torch.Tensor, "type", cuda_type)
        adam = get_megatron_optimizer(config, [ddp])
    for group in adam.param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    return ddp, adam


def fp32_master_weights(gpt, optimizer) -> dict[str, torch.Tensor]:
    """The fp32 master weights ``optimizer`` (``megatron_adam``'s) keeps of ``gpt``'s params, by
    state-dict name: the mixed-precision optimizer's ``main_param`` of each, or the distributed
    optimizer's shards (whole on its one data-parallel rank) of the 16-bit params, or the fp32 params
    themselves."""
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    shards = {}
    for model_group, shard_group in zip(getattr(inner, "model_float16_groups", []),
                                        getattr(inner, "shard_fp32_from_float16_groups", [])):
        shards |= {id(param): shard for param, shard in zip(model_group, shard_group)}
    out = {}
    for name, param in gpt.named_parameters():
        master = getattr(param, "main_param", None)  # the distributed optimizer's is its flat shard
        if master is None:
            master = shards.get(id(param), param)
        out[name] = master.detach().float().reshape(param.shape).clone()
    return out


def in_model_names(tensors: dict[str, torch.Tensor], gpt) -> dict[str, torch.Tensor]:
    """``tensors`` (Megatron names) with each MTP layer's name as ``gpt``'s state dict spells it:
    ``transformer_layer`` in megatron-core 0.16, ``mtp_model_layer`` in 0.19."""
    names = set(gpt.state_dict())

    def renamed(name: str) -> str:
        for old, new in (("transformer_layer.", "mtp_model_layer."), ("mtp_model_layer.", "transformer_layer.")):
            if name not in names and name.replace(old, new, 1) in names:
                return name.replace(old, new, 1)
        return name

    return {renamed(name): tensor for name, tensor in tensors.items()}
