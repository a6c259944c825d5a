"""megatron-core as the tests' oracle: its ``GPTModel`` built on the CPU from an lmfunc
``ModelConfig``, under a one-rank gloo process group (an in-process store, no port).

megatron-core targets CUDA; three calls need the CPU here, and ``megatron_on_cpu`` patches them for
the duration: RoPE moves its frequencies to ``torch.cuda.current_device()``, attention dropout
enters the CUDA RNG tracker's ``fork()``, and the checkpoint writer calls
``torch.cuda.synchronize()``. Only tests use this module; lmfunc never imports megatron-core.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from lmfunc.config.model import ModelConfig

megatron = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]'); the Megatron oracle tests need it")


class _NoCudaRngTracker:
    """The CUDA RNG tracker's ``fork()`` as a no-op: dropout draws from the CPU generator."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def megatron_on_cpu(tp: int = 1, pp: int = 1) -> Iterator[None]:
    """megatron-core's model-parallel state on a one-rank gloo group (created here unless one
    exists) with the CUDA-only calls patched (module docstring); everything undone on exit."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import dot_product_attention

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    patches = pytest.MonkeyPatch()
    patches.setattr(torch.cuda, "current_device", lambda: "cpu")
    patches.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    patches.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *args, **kwargs: _NoCudaRngTracker())
    patches.setattr(dot_product_attention.tensor_parallel, "get_cuda_rng_tracker",
                    lambda *args, **kwargs: _NoCudaRngTracker())
    parallel_state.initialize_model_parallel(tp, pp)
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


def megatron_gpt(cfg: ModelConfig, pre_process: bool = True, post_process: bool = True):
    """megatron-core's ``GPTModel`` (local layer spec, fp32, CPU, no dropout) with ``cfg``'s
    architecture; call inside ``megatron_on_cpu``. ``pre_process``/``post_process``: whether this
    pipeline stage holds the embedding / the output layer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core import parallel_state

    swiglu = cfg.activation == "swiglu"
    config = TransformerConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(), pipeline_dtype=torch.float32,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.ffn_size,
        gated_linear_unit=swiglu, activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_bias_linear, qk_layernorm=cfg.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
    return GPTModel(config, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                    position_embedding_type="rope" if cfg.position_embedding_type == "rope" else "learned_absolute",
                    rotary_percent=cfg.rotary_percent, rotary_base=int(cfg.rotary_base),
                    share_embeddings_and_output_weights=cfg.tie_embeddings, pre_process=pre_process,
                    post_process=post_process)


def megatron_logits(gpt, tokens: torch.Tensor) -> torch.Tensor:
    """``gpt``'s logits ``[B, S, V]`` for ``tokens`` ``[B, S]`` (causal mask, positions 0..S-1)."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return gpt(tokens, positions, mask)
