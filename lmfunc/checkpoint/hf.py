"""Hugging Face Llama weights: lmfunc params <-> ``LlamaForCausalLM`` safetensors + ``config.json``.

A model is Llama-compatible when it uses RoPE on the whole head (rotate-half pairs, as HF and
Megatron), RMSNorm, SwiGLU, no QK-norm and no MTP depths. lmfunc stores projections ``[in, out]``
(``x @ w``); HF stores ``nn.Linear`` weights ``[out, in]``, so matrices are transposed both ways.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.model import param_shapes
from lmfunc.model.gpt import stack_layers, unstack_layers
from lmfunc.tree import PyTree, flatten_with_paths, tree_map_with_path

# (lmfunc name, HF name, transposed): "{i}" is the layer index.
_LAYER_MAP = [
    ("layers.{i}.attn_norm.scale", "model.layers.{i}.input_layernorm.weight", False),
    ("layers.{i}.attn.wq", "model.layers.{i}.self_attn.q_proj.weight", True),
    ("layers.{i}.attn.wk", "model.layers.{i}.self_attn.k_proj.weight", True),
    ("layers.{i}.attn.wv", "model.layers.{i}.self_attn.v_proj.weight", True),
    ("layers.{i}.attn.wo", "model.layers.{i}.self_attn.o_proj.weight", True),
    ("layers.{i}.attn.bq", "model.layers.{i}.self_attn.q_proj.bias", False),
    ("layers.{i}.attn.bk", "model.layers.{i}.self_attn.k_proj.bias", False),
    ("layers.{i}.attn.bv", "model.layers.{i}.self_attn.v_proj.bias", False),
    ("layers.{i}.attn.bo", "model.layers.{i}.self_attn.o_proj.bias", False),
    ("layers.{i}.mlp_norm.scale", "model.layers.{i}.post_attention_layernorm.weight", False),
    ("layers.{i}.mlp.w_gate", "model.layers.{i}.mlp.gate_proj.weight", True),
    ("layers.{i}.mlp.w_up", "model.layers.{i}.mlp.up_proj.weight", True),
    ("layers.{i}.mlp.w_out", "model.layers.{i}.mlp.down_proj.weight", True),
    ("layers.{i}.mlp.b_gate", "model.layers.{i}.mlp.gate_proj.bias", False),
    ("layers.{i}.mlp.b_up", "model.layers.{i}.mlp.up_proj.bias", False),
    ("layers.{i}.mlp.b_out", "model.layers.{i}.mlp.down_proj.bias", False),
]
_GLOBAL_MAP = [
    ("embed.tokens", "model.embed_tokens.weight", False),
    ("final_norm.scale", "model.norm.weight", False),
    ("output", "lm_head.weight", True),
]


def _name_map(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """``{lmfunc name: (HF name, transposed)}`` for every leaf of ``cfg``'s parameter tree, with
    the blocks unstacked (``layers.<i>.*``) also for a ``scan_layers`` model."""
    names = {name for name, _ in flatten_with_paths(param_shapes(_unstacked(cfg)))}
    table = list(_GLOBAL_MAP) + [(ours.format(i=i), theirs.format(i=i), t)
                                 for i in range(cfg.num_layers) for ours, theirs, t in _LAYER_MAP]
    return {ours: (theirs, t) for ours, theirs, t in table if ours in names}


def _unstacked(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, scan_layers=False)


def check_llama_compatible(cfg: ModelConfig) -> None:
    """Raise ``ConfigError`` naming each setting the HF Llama layout cannot express."""
    problems = [message for failed, message in (
        (cfg.position_embedding_type != "rope", f"model.position_embedding_type is {cfg.position_embedding_type!r} (Llama: 'rope')"),
        (cfg.rotary_percent != 1.0, f"model.rotary_percent is {cfg.rotary_percent} (Llama rotates the whole head: 1.0)"),
        (cfg.normalization != "RMSNorm", f"model.normalization is {cfg.normalization!r} (Llama: 'RMSNorm')"),
        (cfg.activation != "swiglu", f"model.activation is {cfg.activation!r} (Llama: 'swiglu')"),
        (cfg.qk_layernorm, "model.qk_layernorm is on (Llama has no QK-norm)"),
        (cfg.mtp_num_layers > 0, f"model.mtp_num_layers is {cfg.mtp_num_layers} (Llama has no MTP modules)"),
        (cfg.num_experts is not None, f"model.num_experts is {cfg.num_experts} (Llama has no MoE layers)"),
    ) if failed]
    if problems:
        raise ConfigError("the model is not Llama-compatible: " + "; ".join(problems)
                          + ". Export it as plain safetensors instead (--format safetensors)")


def llama_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``cfg`` (checked compatible first)."""
    check_llama_compatible(cfg)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
        "initializer_range": cfg.init_method_std, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.seq_len_interpolation_factor is not None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": cfg.seq_len_interpolation_factor}
    return config


def to_llama_state_dict(params: PyTree, cfg: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """HF-named, ``[out, in]`` tensors of full (consolidated) ``params``."""
    mapping = _name_map(cfg)
    if cfg.scan_layers:
        params = unstack_layers(params, cfg.num_layers)
    out = {}
    for name, leaf in flatten_with_paths(params):
        hf_name, transposed = mapping[name]
        tensor = leaf.detach().t() if transposed else leaf.detach()
        out[hf_name] = tensor.to(dtype or tensor.dtype).contiguous()
    return out


def save_llama(params: PyTree, cfg: ModelConfig, directory: str, dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/model.safetensors`` and ``directory/config.json`` (loadable by
    ``transformers.LlamaForCausalLM.from_pretrained``)."""
    config = llama_config(cfg, dtype)
    os.makedirs(directory, exist_ok=True)
    save_file(to_llama_state_dict(params, cfg, dtype), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _rope(config: dict) -> tuple[Optional[float], Optional[dict]]:
    """(theta, scaling) from a config.json of either transformers generation."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    scaling = config.get("rope_scaling")
    if params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling


def check_config_matches(config: dict, cfg: ModelConfig, source: str) -> None:
    """Raise ``ConfigError`` naming every HF config field that disagrees with ``cfg``."""
    theta, scaling = _rope(config)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "linear":
        raise ConfigError(f"{source}: rope scaling {scaling} is not supported (only linear position interpolation)")
    factor = scaling.get("factor") if scaling is not None else None
    pairs = [
        ("vocab_size", "model.vocab_size", cfg.vocab_size), ("hidden_size", "model.hidden_size", cfg.hidden_size),
        ("intermediate_size", "model.ffn_hidden_size", cfg.ffn_size),
        ("num_hidden_layers", "model.num_layers", cfg.num_layers),
        ("num_attention_heads", "model.num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", "model.num_query_groups", cfg.query_groups),
        ("head_dim", "model.kv_channels", cfg.head_dim), ("rms_norm_eps", "model.norm_epsilon", cfg.norm_epsilon),
        ("rope_theta", "model.rotary_base", cfg.rotary_base),
        ("rope_scaling.factor", "model.seq_len_interpolation_factor", cfg.seq_len_interpolation_factor),
        ("tie_word_embeddings", "model.tie_embeddings", cfg.tie_embeddings),
        ("attention_bias", "model.add_bias_linear", cfg.add_bias_linear),
        ("mlp_bias", "model.add_bias_linear", cfg.add_bias_linear),
        ("hidden_act", "model.activation", "silu"),
    ]
    found = dict(config, rope_theta=theta, **{"rope_scaling.factor": factor})
    found.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    found.setdefault("head_dim", config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1))
    for key, default in (("tie_word_embeddings", False), ("attention_bias", False), ("mlp_bias", False)):
        found.setdefault(key, default)
    differing = [f"{key} is {found.get(key)!r} but {ours} gives {value!r}"
                 for key, ours, value in pairs if found.get(key) != value]
    if differing:
        raise ConfigError(f"{source} does not match the model config: " + "; ".join(differing))


def load_llama(directory: str, cfg: ModelConfig) -> PyTree:
    """lmfunc params (fp32) from a HF Llama directory (``config.json`` + one or more ``*.safetensors``)."""
    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint.load_hf: {config_path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"checkpoint.load_hf: {config_path} is not valid JSON: {err}") from None
    check_llama_compatible(cfg)
    check_config_matches(config, cfg, config_path)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ConfigError(f"checkpoint.load_hf: {directory} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except SafetensorError as err:
            raise ConfigError(f"checkpoint.load_hf: {path} is not a readable safetensors file: {err}") from None
    mapping = _name_map(cfg)
    missing = sorted(theirs for theirs, _ in mapping.values() if theirs not in tensors)
    if missing:
        raise ConfigError(f"checkpoint.load_hf: {directory} lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def fill(name: str, like: torch.Tensor) -> torch.Tensor:
        theirs, transposed = mapping[name]
        tensor = tensors[theirs].t() if transposed else tensors[theirs]
        if tuple(tensor.shape) != tuple(like.shape):
            raise ConfigError(f"checkpoint.load_hf: {theirs} has shape {tuple(tensors[theirs].shape)}, "
                              f"the model expects {tuple(like.shape[::-1]) if transposed else tuple(like.shape)}")
        return tensor.to(torch.float32).contiguous()

    params = tree_map_with_path(fill, param_shapes(_unstacked(cfg)))
    return stack_layers(params) if cfg.scan_layers else params
