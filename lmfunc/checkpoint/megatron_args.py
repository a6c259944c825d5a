"""Megatron-LM's arguments <-> lmfunc's model settings.

Megatron's training loop stores its whole argument ``Namespace`` in every checkpoint (``args`` in
``common.pt`` or in the legacy ``model_optim_rng.pt``). ``model_settings`` reads the model's
architecture from it as ``ModelConfig`` fields, and refuses by name every setting lmfunc cannot
express; ``megatron_arguments`` writes the flags that build a megatron-core ``GPTModel`` of an
lmfunc model (for an export).
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from typing import Any

from lmfunc.config.model import ConfigError, ModelConfig

_REFUSED = [
    # (Megatron argument, the value lmfunc needs, what lmfunc lacks)
    ("rotary_interleaved", False, "interleaved RoPE pairs (lmfunc rotates halves, Megatron's default)"),
    ("apply_layernorm_1p", False, "zero-centred norm weights (--apply-layernorm-1p)"),
    ("squared_relu", False, "the squared-ReLU activation"),
    ("openai_gelu", False, "the tanh-approximated GELU (--openai-gelu)"),
    ("use_rope_scaling", False, "Llama-3.1 RoPE scaling (--use-rope-scaling)"),
    ("add_qkv_bias", None, "QKV biases without the other linear biases (--add-qkv-bias)"),
]


def _get(args: Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def model_settings(args: Namespace, source: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of the model Megatron's ``args`` describe. Raises ``ConfigError``
    naming each argument whose setting lmfunc cannot express (``source`` names the file)."""
    problems = []
    for name, allowed, what in _REFUSED:
        value = _get(args, name)
        if name == "add_qkv_bias":
            if value and not _get(args, "add_bias_linear", True):
                problems.append(f"{name}={value!r}: {what}")
        elif value not in (allowed, None):
            problems.append(f"{name}={value!r}: {what}")
    position = _get(args, "position_embedding_type", "learned_absolute")
    if position not in ("rope", "learned_absolute"):
        problems.append(f"position_embedding_type={position!r}: lmfunc has 'rope' and 'learned_absolute'")
    normalization = _get(args, "normalization", "LayerNorm")
    if normalization not in ("RMSNorm", "LayerNorm"):
        problems.append(f"normalization={normalization!r}: lmfunc has 'RMSNorm' and 'LayerNorm'")
    moe, moe_problems = _moe_settings(args)
    mla, mla_problems = _mla_settings(args)
    problems += moe_problems + mla_problems
    if problems:
        raise ConfigError(f"{source} holds a Megatron model lmfunc cannot express: " + "; ".join(problems))
    heads = args.num_attention_heads
    settings: dict[str, Any] = {
        "vocab_size": _get(args, "padded_vocab_size"),
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "num_attention_heads": heads,
        "num_query_groups": args.num_query_groups if _get(args, "group_query_attention") else heads,
        "kv_channels": _get(args, "kv_channels") or args.hidden_size // heads,
        "ffn_hidden_size": _get(args, "ffn_hidden_size"),
        "max_position_embeddings": _get(args, "max_position_embeddings"),
        "position_embedding_type": position,
        "rotary_base": float(_get(args, "rotary_base", 10000)),
        "rotary_percent": float(_get(args, "rotary_percent", 1.0)),
        "seq_len_interpolation_factor": _get(args, "rotary_seq_len_interpolation_factor"),
        "normalization": normalization,
        "norm_epsilon": float(_get(args, "norm_epsilon", 1e-5)),
        "activation": "swiglu" if _get(args, "swiglu") else "gelu",
        "qk_layernorm": bool(_get(args, "qk_layernorm", False)),
        "add_bias_linear": bool(_get(args, "add_bias_linear", True)),
        "tie_embeddings": not _get(args, "untie_embeddings_and_output_weights", False),
        "init_method_std": float(_get(args, "init_method_std", 0.02)),
        "mtp_num_layers": int(_get(args, "mtp_num_layers") or 0),
        "mtp_loss_scaling_factor": float(_get(args, "mtp_loss_scaling_factor", 0.1)),
    }
    if mla:  # MLA replaces the query groups, the head size and the partial RoPE; its latents are always normed
        for name in ("num_query_groups", "kv_channels", "qk_layernorm", "rotary_percent"):
            settings.pop(name)
    return {name: value for name, value in (settings | moe | mla).items() if value is not None}


_MOE_REFUSED = [
    # (Megatron argument, the value lmfunc needs, what lmfunc lacks)
    ("moe_input_jitter_eps", None, "router input jitter (--moe-input-jitter-eps)"),
    ("moe_shared_expert_gate", False, "a gated shared expert (--moe-shared-expert-gate)"),
    ("moe_router_topk_limited_devices", None, "device-limited routing (--moe-router-topk-limited-devices)"),
    ("moe_use_upcycling", False, "upcycling a dense checkpoint (--moe-use-upcycling)"),
]

_MOE_FIELDS = ("moe_router_topk", "moe_shared_expert_intermediate_size", "moe_router_score_function",
               "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_load_balancing_type",
               "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy")
"""MoE settings whose Megatron argument and lmfunc field share a name and a meaning."""


def _moe_settings(args: Namespace) -> tuple[dict[str, Any], list[str]]:
    """The MoE fields of ``args`` (none for a dense model) and the MoE settings lmfunc lacks."""
    if not _get(args, "num_experts"):
        return {}, []
    problems = [f"{name}={_get(args, name)!r}: {what}" for name, allowed, what in _MOE_REFUSED
                if _get(args, name) not in (allowed, None, 0, 0.0, False)]
    balancing = _get(args, "moe_router_load_balancing_type", "aux_loss")
    coeff = _get(args, "moe_aux_loss_coeff", 0.0)
    if isinstance(balancing, (list, tuple)) or isinstance(coeff, (list, tuple)):
        if len(balancing if isinstance(balancing, (list, tuple)) else [balancing]) > 1:
            problems.append(f"moe_router_load_balancing_type={balancing!r}: lmfunc takes one load-balancing loss")
        balancing = balancing[0] if isinstance(balancing, (list, tuple)) else balancing
        coeff = coeff[0] if isinstance(coeff, (list, tuple)) else coeff
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        problems.append(f"moe_router_load_balancing_type={balancing!r}: lmfunc has 'aux_loss', 'seq_aux_loss' and 'none'")
    freq = _get(args, "moe_layer_freq", 1)
    settings = {"num_experts": int(args.num_experts), "moe_ffn_hidden_size": _get(args, "moe_ffn_hidden_size"),
                "moe_layer_freq": tuple(freq) if isinstance(freq, (list, tuple)) else int(freq),
                "moe_aux_loss_coeff": float(coeff or 0.0)}
    settings |= {name: _get(args, name) for name in _MOE_FIELDS if _get(args, name) is not None}
    settings["moe_router_load_balancing_type"] = balancing
    return settings, problems


def _mla_settings(args: Namespace) -> tuple[dict[str, Any], list[str]]:
    """The MLA fields of ``args`` (none without MLA) and the MLA settings lmfunc lacks."""
    if not _get(args, "multi_latent_attention"):
        return {}, []
    problems = []
    if _get(args, "rope_type") != "rope":
        problems.append(f"rope_type={_get(args, 'rope_type')!r}: lmfunc's MLA rotates with plain RoPE (Megatron's "
                        "--rope-type rope); YaRN, MLA's default in Megatron, is not implemented")
    if not _get(args, "qk_layernorm"):
        problems.append("qk_layernorm=False with MLA: lmfunc's MLA always norms its latents (Megatron's --qk-layernorm)")
    factor, all_dims = float(_get(args, "rotary_scaling_factor", 1.0) or 1.0), float(_get(args, "mscale_all_dim", 0.0) or 0.0)
    if factor > 1 and all_dims:
        problems.append(f"mscale_all_dim={all_dims!r} with rotary_scaling_factor={factor!r}: a YaRN attention scale")
    if float(_get(args, "rotary_percent", 1.0)) != 1.0:
        problems.append(f"rotary_percent={_get(args, 'rotary_percent')!r} with MLA: lmfunc rotates all qk_pos_emb_head_dim dims")
    settings = {"multi_latent_attention": True, "q_lora_rank": _get(args, "q_lora_rank")}
    settings |= {name: int(_get(args, name)) for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
                 if _get(args, name) is not None}
    return settings, problems


_RESOLVED = {"num_query_groups": "query_groups", "kv_channels": "head_dim", "ffn_hidden_size": "ffn_size",
             "moe_ffn_hidden_size": "expert_ffn_size"}
"""Model fields that may be None in a config: the property holding the value they resolve to."""


def mismatches(settings: dict[str, Any], cfg: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """``{field: (the checkpoint's value, cfg's value)}`` for every model setting that differs
    (optional fields compared by what they resolve to: ``kv_channels`` None is hidden / heads)."""
    out = {}
    for name, value in settings.items():
        ours = getattr(cfg, _RESOLVED.get(name, name))
        if name == "moe_layer_freq":  # 1 and (1, 1, ...) are the same layers
            theirs = dataclasses.replace(cfg, moe_layer_freq=value).moe_layers if _fits(value, cfg) else None
            if theirs != cfg.moe_layers:
                out[name] = (value, ours)
            continue
        if ours != value and not (isinstance(value, float) and isinstance(ours, (int, float)) and float(ours) == value):
            out[name] = (value, ours)
    return out


def _fits(freq: Any, cfg: ModelConfig) -> bool:
    """Whether the MoE layer pattern ``freq`` has one entry per layer of ``cfg`` (an int always fits)."""
    return not isinstance(freq, tuple) or len(freq) == cfg.num_layers


def flag(name: str, value: Any) -> str:
    """lmfunc's command-line flag that sets model field ``name`` to ``value``."""
    option = "--model." + name.replace("_", "-")
    if isinstance(value, bool):
        return option if value else "--model.no-" + name.replace("_", "-")
    if isinstance(value, tuple):
        return f"{option} {' '.join(map(str, value))}"
    return f"{option} {value}"


def megatron_arguments(cfg: ModelConfig) -> list[str]:
    """Megatron-LM's command-line arguments for ``cfg``'s architecture (``pretrain_gpt.py``; the
    same settings build a megatron-core ``GPTModel``): the vocabulary is given padded, as lmfunc's
    table already is (``--make-vocab-size-divisible-by 1`` keeps it)."""
    arguments = [
        f"--num-layers {cfg.num_layers}", f"--hidden-size {cfg.hidden_size}",
        f"--ffn-hidden-size {cfg.ffn_size}", f"--num-attention-heads {cfg.num_attention_heads}",
        f"--kv-channels {cfg.head_dim}", f"--max-position-embeddings {cfg.max_position_embeddings}",
        f"--position-embedding-type {cfg.position_embedding_type}", f"--normalization {cfg.normalization}",
        f"--norm-epsilon {cfg.norm_epsilon}", f"--init-method-std {cfg.init_method_std}",
        "--make-vocab-size-divisible-by 1", f"# vocabulary: {cfg.vocab_size} entries (a tokenizer of that size)",
    ]
    if cfg.query_groups != cfg.num_attention_heads and not cfg.multi_latent_attention:
        arguments += ["--group-query-attention", f"--num-query-groups {cfg.query_groups}"]
    if cfg.position_embedding_type == "rope":
        arguments += [f"--rotary-base {int(cfg.rotary_base)}", f"--rotary-percent {cfg.rotary_percent}"]
        if cfg.seq_len_interpolation_factor is not None:
            arguments.append(f"--rotary-seq-len-interpolation-factor {cfg.seq_len_interpolation_factor}")
    if cfg.activation == "swiglu":
        arguments.append("--swiglu")
    if not cfg.add_bias_linear:
        arguments.append("--disable-bias-linear")
    if cfg.qk_layernorm:
        arguments.append("--qk-layernorm")
    if not cfg.tie_embeddings:
        arguments.append("--untie-embeddings-and-output-weights")
    return arguments + _moe_arguments(cfg) + _mla_arguments(cfg) + (
        [f"--mtp-num-layers {cfg.mtp_num_layers}", f"--mtp-loss-scaling-factor {cfg.mtp_loss_scaling_factor}"]
        if cfg.mtp_num_layers else [])


def _moe_arguments(cfg: ModelConfig) -> list[str]:
    """Megatron's MoE arguments for ``cfg`` (none for a dense model); the layer pattern as 1 when
    every layer is an MoE layer (megatron-core then stacks the layers in its saves), else as a list."""
    if cfg.num_experts is None:
        return []
    freq = "1" if all(cfg.moe_layers) else "'[" + ",".join(str(int(moe)) for moe in cfg.moe_layers) + "]'"
    arguments = [f"--num-experts {cfg.num_experts}", f"--moe-ffn-hidden-size {cfg.expert_ffn_size}",
                 f"--moe-layer-freq {freq}", f"--moe-aux-loss-coeff {cfg.moe_aux_loss_coeff}"]
    for name in _MOE_FIELDS:
        value = getattr(cfg, name)
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            arguments += [option] if value else []
        elif value is not None:
            arguments.append(f"{option} {value}")
    return arguments


def _mla_arguments(cfg: ModelConfig) -> list[str]:
    """Megatron's MLA arguments for ``cfg`` (none without MLA): plain RoPE and normed latents, as lmfunc's."""
    if not cfg.multi_latent_attention:
        return []
    arguments = ["--multi-latent-attention", "--rope-type rope", "--qk-layernorm", f"--kv-lora-rank {cfg.kv_lora_rank}",
                 f"--qk-head-dim {cfg.qk_head_dim}", f"--qk-pos-emb-head-dim {cfg.qk_pos_emb_head_dim}",
                 f"--v-head-dim {cfg.v_head_dim}"]
    return arguments + ([f"--q-lora-rank {cfg.q_lora_rank}"] if cfg.q_lora_rank is not None else [])


def schedule_mismatches(args: Namespace, settings: dict[str, Any]) -> dict[str, tuple[Any, Any, str]]:
    """Where lmfunc's lr schedule, batch and loss normalisation (``settings``: lr, min_lr,
    lr_decay_style, lr_warmup_init, the resolved warmup and decay in iterations,
    global_batch_size, calculate_per_token_loss, whose default differs: Megatron's False scales the
    router losses' gradient otherwise; and, when both runs scale an fp16 loss dynamically, the
    scaler's loss_scale_window, hysteresis and min_loss_scale) differ from the ones Megatron's ``args`` ran with: ``{name: (Megatron's, lmfunc's, the lmfunc flag that
    sets it to Megatron's)}``. Megatron's decay defaults to its ``train_iters``; a
    ``--lr-warmup-fraction`` is resolved as Megatron does."""
    decay = _get(args, "lr_decay_iters") or _get(args, "train_iters")
    warmup = _get(args, "lr_warmup_iters", 0)
    if _get(args, "lr_warmup_fraction") is not None and decay is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    theirs = {"lr": _get(args, "lr"), "min_lr": _get(args, "min_lr", 0.0), "lr_decay_style": _get(args, "lr_decay_style"),
              "lr_warmup_init": _get(args, "lr_warmup_init", 0.0), "lr_warmup_iters": warmup, "lr_decay_iters": decay,
              "global_batch_size": _get(args, "global_batch_size"),
              "calculate_per_token_loss": bool(_get(args, "calculate_per_token_loss", False))}
    if _get(args, "fp16", False) and _get(args, "loss_scale") is None:  # Megatron's dynamic loss scaler
        theirs |= {"loss_scale_window": _get(args, "loss_scale_window", 1000), "hysteresis": _get(args, "hysteresis", 2),
                   "min_loss_scale": _get(args, "min_loss_scale", 1.0)}
    options = {"global_batch_size": "--run.global-batch-size", "loss_scale_window": "--precision.loss-scale-window",
               "hysteresis": "--precision.hysteresis", "min_loss_scale": "--precision.min-loss-scale"}
    out = {}
    for name, value in theirs.items():
        if value is None or name not in settings:
            continue
        ours = settings[name]
        same = float(ours) == float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else ours == value
        if not same and isinstance(value, bool):  # the loss normalisation: a run flag
            out[name] = (value, ours, "--run." + ("" if value else "no-") + name.replace("_", "-"))
        elif not same:
            out[name] = (value, ours, f"{options.get(name, '--optim.' + name.replace('_', '-'))} {value}")
    return out
