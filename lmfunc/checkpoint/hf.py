"""Hugging Face weights: lmfunc params <-> safetensors + ``config.json`` of ``LlamaForCausalLM``
(dense models) or ``Qwen3MoeForCausalLM`` (mixture-of-experts models).

A dense model is Llama-compatible when it uses RoPE on the whole head (rotate-half pairs, as HF and
Megatron), RMSNorm, SwiGLU, no QK-norm and no MTP depths. An MoE model is Qwen3-MoE-compatible
with the same, QK-norm on, and Qwen3-MoE's router: softmax top-k renormalised over the k, no
scaling, groups, expert bias or shared experts. lmfunc stores projections ``[in, out]`` (``x @ w``);
HF stores ``nn.Linear`` weights ``[out, in]``, so matrices are transposed both ways. lmfunc's
stacked experts ``[E, h, f]`` are HF's per-expert tensors ``experts.<j>.*`` (the Hub's layout,
which ``save_pretrained`` writes too).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Optional, Union

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
_MOE_MAP = [
    ("layers.{i}.mlp.router.weight", "model.layers.{i}.mlp.gate.weight", True),
    ("layers.{i}.attn.q_norm.scale", "model.layers.{i}.self_attn.q_norm.weight", False),
    ("layers.{i}.attn.k_norm.scale", "model.layers.{i}.self_attn.k_norm.weight", False),
]
_EXPERT_MAP = [
    ("layers.{i}.mlp.experts.w_gate", "model.layers.{i}.mlp.experts.{j}.gate_proj.weight"),
    ("layers.{i}.mlp.experts.w_up", "model.layers.{i}.mlp.experts.{j}.up_proj.weight"),
    ("layers.{i}.mlp.experts.w_out", "model.layers.{i}.mlp.experts.{j}.down_proj.weight"),
]
_GLOBAL_MAP = [
    ("embed.tokens", "model.embed_tokens.weight", False),
    ("final_norm.scale", "model.norm.weight", False),
    ("output", "lm_head.weight", True),
]

HfNames = Union[str, list[str]]
"""One HF tensor, or one per expert (stacked along lmfunc's leading expert axis)."""


def _name_map(cfg: ModelConfig) -> dict[str, tuple[HfNames, bool]]:
    """``{lmfunc name: (HF name(s), transposed)}`` for every leaf of ``cfg``'s parameter tree, with
    the blocks unstacked (``layers.<i>.*``) also for a ``scan_layers`` model."""
    names = {name for name, _ in flatten_with_paths(param_shapes(_unstacked(cfg)))}
    table = list(_GLOBAL_MAP) + [(ours.format(i=i), theirs.format(i=i), t) for i in range(cfg.num_layers)
                                 for ours, theirs, t in _LAYER_MAP + _MOE_MAP]
    table += [(ours.format(i=i), [theirs.format(i=i, j=j) for j in range(cfg.num_experts or 0)], True)
              for i in range(cfg.num_layers) for ours, theirs in _EXPERT_MAP]
    return {ours: (theirs, t) for ours, theirs, t in table if ours in names}


def _unstacked(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, scan_layers=False)


EXPORT_ADVICE = "Export it as plain safetensors instead (--format safetensors)"


def check_hf_compatible(cfg: ModelConfig, advice: str = EXPORT_ADVICE) -> None:
    """Raise ``ConfigError`` naming each setting that the HF layout of ``cfg`` (Llama for a dense
    model, Qwen3-MoE with experts) cannot express, then ``advice``."""
    moe = cfg.num_experts is not None
    name = "Qwen3-MoE" if moe else "Llama"
    problems = [message for failed, message in (
        (cfg.position_embedding_type != "rope", f"model.position_embedding_type is {cfg.position_embedding_type!r} ({name}: 'rope')"),
        (cfg.rotary_percent != 1.0, f"model.rotary_percent is {cfg.rotary_percent} ({name} rotates the whole head: 1.0)"),
        (cfg.normalization != "RMSNorm", f"model.normalization is {cfg.normalization!r} ({name}: 'RMSNorm')"),
        (cfg.activation != "swiglu", f"model.activation is {cfg.activation!r} ({name}: 'swiglu')"),
        (cfg.qk_layernorm and not moe, "model.qk_layernorm is on (Llama has no QK-norm)"),
        (moe and not cfg.qk_layernorm, "model.qk_layernorm is off (Qwen3-MoE normalises queries and keys)"),
        (cfg.mtp_num_layers > 0, f"model.mtp_num_layers is {cfg.mtp_num_layers} ({name} has no MTP modules)"),
        (cfg.multi_latent_attention, f"model.multi_latent_attention is on ({name} has no MLA)"),
        (moe and cfg.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_intermediate_size is "
         f"{cfg.moe_shared_expert_intermediate_size} (Qwen3-MoE has no shared experts)"),
        (moe and (cfg.moe_router_score_function != "softmax" or cfg.moe_router_pre_softmax),
         "the router is not softmax top-k renormalised over the k (Qwen3-MoE's: --model.moe-router-score-function "
         "softmax without --model.moe-router-pre-softmax)"),
        (moe and bool(cfg.moe_router_topk_scaling_factor), "model.moe_router_topk_scaling_factor is set (Qwen3-MoE has none)"),
        (moe and cfg.moe_router_num_groups is not None, "model.moe_router_num_groups is set (Qwen3-MoE routes without groups)"),
        (moe and cfg.moe_router_enable_expert_bias, "model.moe_router_enable_expert_bias is on (Qwen3-MoE has no expert bias)"),
    ) if failed]
    if problems:
        raise ConfigError(f"the model is not {name}-compatible: " + "; ".join(problems) + f". {advice}")


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` or, with experts, ``Qwen3MoeForCausalLM`` for
    ``cfg`` (checked compatible first)."""
    check_hf_compatible(cfg)
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
    if cfg.num_experts is not None:
        del config["mlp_bias"]
        config |= {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": cfg.expert_ffn_size, "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, is_moe in enumerate(cfg.moe_layers) if not is_moe],
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        }
    if cfg.seq_len_interpolation_factor is not None:
        config["rope_scaling"] = {"rope_type": "linear", "factor": cfg.seq_len_interpolation_factor}
    return config


def to_hf_state_dict(params: PyTree, cfg: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """HF-named, ``[out, in]`` tensors of full (consolidated) ``params``; stacked experts become one
    tensor per expert."""
    mapping = _name_map(cfg)
    if cfg.scan_layers:
        params = unstack_layers(params, cfg.num_layers)
    out = {}
    for name, leaf in flatten_with_paths(params):
        hf_names, transposed = mapping[name]
        parts = zip(hf_names, leaf.detach().unbind(0)) if isinstance(hf_names, list) else [(hf_names, leaf.detach())]
        for hf_name, tensor in parts:
            tensor = tensor.t() if transposed else tensor
            out[hf_name] = tensor.to(dtype or tensor.dtype).contiguous()
    return out


def save_hf(params: PyTree, cfg: ModelConfig, directory: str, dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/model.safetensors`` and ``directory/config.json`` (loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained``)."""
    config = hf_config(cfg, dtype)
    os.makedirs(directory, exist_ok=True)
    save_file(to_hf_state_dict(params, cfg, dtype), os.path.join(directory, "model.safetensors"),
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


def _flag(field: str, value: object) -> str:
    """The command-line flag that sets ``model.<field>`` to ``value``."""
    name = field.replace("_", "-")
    if isinstance(value, bool):
        return f"--model.{name}" if value else f"--model.no-{name}"
    if isinstance(value, (list, tuple)):
        return f"--model.{name} " + " ".join(str(v) for v in value)
    return f"--model.{name} {value}"


def _hf_settings(config: dict) -> dict[str, object]:
    """The lmfunc model settings (``ModelConfig`` field -> value) a Llama or Qwen3-MoE
    ``config.json`` holds; the keys it lacks take transformers' defaults."""
    theta, scaling = _rope(config)
    heads = config.get("num_attention_heads")
    settings = {
        "vocab_size": config.get("vocab_size"), "hidden_size": config.get("hidden_size"),
        "ffn_hidden_size": config.get("intermediate_size"), "num_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads, "num_query_groups": config.get("num_key_value_heads", heads),
        "kv_channels": config.get("head_dim", config.get("hidden_size", 0) // max(heads or 1, 1)),
        "norm_epsilon": config.get("rms_norm_eps"), "rotary_base": theta,
        "seq_len_interpolation_factor": scaling.get("factor") if scaling is not None else None,
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "add_bias_linear": config.get("attention_bias", False),
        "qk_layernorm": config.get("model_type") == "qwen3_moe", "num_experts": None,
    }
    if config.get("model_type") == "qwen3_moe":
        step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
        settings |= {
            "num_experts": config.get("num_experts"), "moe_router_topk": config.get("num_experts_per_tok"),
            "moe_ffn_hidden_size": config.get("moe_intermediate_size"),
            "moe_layer_freq": tuple(int(i not in dense and (i + 1) % step == 0)
                                    for i in range(config.get("num_hidden_layers") or 0)),
        }
    return settings


def _our_settings(cfg: ModelConfig) -> dict[str, object]:
    """``cfg``'s values of the settings ``_hf_settings`` reads (the resolved sizes)."""
    ours = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.ffn_size,
        "num_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.query_groups, "kv_channels": cfg.head_dim, "norm_epsilon": cfg.norm_epsilon,
        "rotary_base": cfg.rotary_base, "seq_len_interpolation_factor": cfg.seq_len_interpolation_factor,
        "tie_embeddings": cfg.tie_embeddings, "add_bias_linear": cfg.add_bias_linear,
        "qk_layernorm": cfg.qk_layernorm, "num_experts": cfg.num_experts,
    }
    if cfg.num_experts is not None:
        ours |= {"moe_router_topk": cfg.moe_router_topk, "moe_ffn_hidden_size": cfg.expert_ffn_size,
                 "moe_layer_freq": tuple(int(is_moe) for is_moe in cfg.moe_layers)}
    return ours


_HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim", "norm_epsilon": "rms_norm_eps",
    "rotary_base": "rope_theta", "seq_len_interpolation_factor": "rope_scaling.factor",
    "tie_embeddings": "tie_word_embeddings", "add_bias_linear": "attention_bias", "qk_layernorm": "model_type",
    "num_experts": "num_experts", "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size", "moe_layer_freq": "mlp_only_layers",
}
"""The ``config.json`` key each setting of ``_hf_settings`` is read from."""


def describe_hf_config(config: dict) -> str:
    """What model a Llama or Qwen3-MoE ``config.json`` holds, in a few words."""
    arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
    size = (f"{config.get('num_hidden_layers')} layers, hidden size {config.get('hidden_size')}, "
            f"vocabulary {config.get('vocab_size')}")
    if config.get("model_type") == "qwen3_moe":
        dense = config.get("mlp_only_layers") or []
        return (f"a Qwen3-MoE model ({arch}: {size}, {config.get('num_experts')} experts, top-"
                f"{config.get('num_experts_per_tok')}, QK-norm" + (f", dense layers {dense}" if dense else "") + ")")
    return f"a dense Llama model ({arch}: {size})"


def check_config_matches(config: dict, cfg: ModelConfig, source: str) -> None:
    """Raise ``ConfigError`` naming what model ``config`` holds, every field that disagrees with
    ``cfg``, and the flags that make ``cfg`` match it."""
    model_type = config.get("model_type")
    if model_type not in ("llama", "qwen3_moe"):
        raise ConfigError(f"{source} holds a {model_type!r} model ({config.get('architectures')}); lmfunc imports "
                          "Llama (model_type 'llama') and Qwen3-MoE ('qwen3_moe') folders")
    theta, scaling = _rope(config)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "linear":
        raise ConfigError(f"{source}: rope scaling {scaling} is not supported (only linear position interpolation)")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act is {config['hidden_act']!r}; lmfunc imports SwiGLU ('silu') MLPs")
    if model_type == "llama" and config.get("mlp_bias", False) != config.get("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias and mlp_bias differ; lmfunc's model.add_bias_linear sets both")
    if model_type == "qwen3_moe" and not config.get("norm_topk_prob", False):
        raise ConfigError(f"{source}: norm_topk_prob is false; lmfunc's softmax router renormalises the top-k weights")
    theirs, ours = _hf_settings(config), _our_settings(cfg)
    differing = [field for field in theirs if field in ours and theirs[field] != ours[field]]
    if cfg.num_experts is None and theirs["num_experts"] is not None:
        differing += [field for field in ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq")]
    if differing:
        found = [f"{_HF_KEYS[field]} gives {theirs[field]!r} but model.{field} is {ours.get(field)!r}"
                 if field in ("qk_layernorm", "moe_layer_freq") else
                 f"{_HF_KEYS[field]} is {theirs[field]!r} but model.{field} gives {ours.get(field)!r}"
                 for field in differing]
        raise ConfigError(f"{source} holds {describe_hf_config(config)}, which does not match the model config: "
                          + "; ".join(found) + ". To import it, pass "
                          + " ".join(_flag(field, theirs[field]) for field in differing))


def load_hf(directory: str, cfg: ModelConfig) -> PyTree:
    """lmfunc params (fp32) from a HF Llama or Qwen3-MoE directory (``config.json`` + one or more
    ``*.safetensors``)."""
    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint.load_hf: {config_path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"checkpoint.load_hf: {config_path} is not valid JSON: {err}") from None
    check_config_matches(config, cfg, config_path)
    check_hf_compatible(cfg, f"{config_path} holds {describe_hf_config(config)}: to import it, set these as it has them")
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
    wanted = [theirs for names, _ in mapping.values() for theirs in (names if isinstance(names, list) else [names])]
    missing = sorted(theirs for theirs in wanted if theirs not in tensors)
    if missing:
        raise ConfigError(f"checkpoint.load_hf: {directory} lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def one(theirs: str, transposed: bool, like_shape: tuple[int, ...]) -> torch.Tensor:
        tensor = tensors[theirs].t() if transposed else tensors[theirs]
        if tuple(tensor.shape) != like_shape:
            raise ConfigError(f"checkpoint.load_hf: {theirs} has shape {tuple(tensors[theirs].shape)}, "
                              f"the model expects {like_shape[::-1] if transposed else like_shape}")
        return tensor.to(torch.float32)

    def fill(name: str, like: torch.Tensor) -> torch.Tensor:
        theirs, transposed = mapping[name]
        if isinstance(theirs, list):
            return torch.stack([one(expert, transposed, tuple(like.shape[1:])) for expert in theirs])
        return one(theirs, transposed, tuple(like.shape)).contiguous()

    params = tree_map_with_path(fill, param_shapes(_unstacked(cfg)))
    return stack_layers(params) if cfg.scan_layers else params
