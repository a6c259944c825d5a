"""Megatron-LM's arguments <-> lmfunc's model settings.

Megatron's training loop stores its whole argument ``Namespace`` in every checkpoint (``args`` in
``common.pt`` or in the legacy ``model_optim_rng.pt``). ``model_settings`` reads the model's
architecture from it as ``ModelConfig`` fields, and refuses by name every setting lmfunc cannot
express; ``megatron_arguments`` writes the flags that build a megatron-core ``GPTModel`` of an
lmfunc model (for an export).
"""

from __future__ import annotations

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
    for name, what in (("num_experts", "mixture-of-experts layers"), ("multi_latent_attention", "multi-latent attention"),
                       ("mtp_num_layers", "multi-token prediction layers")):
        if _get(args, name):
            problems.append(f"{name}={_get(args, name)!r}: importing {what} from Megatron is not mapped yet")
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
    }
    return {name: value for name, value in settings.items() if value is not None}


_RESOLVED = {"num_query_groups": "query_groups", "kv_channels": "head_dim", "ffn_hidden_size": "ffn_size"}
"""Model fields that may be None in a config: the property holding the value they resolve to."""


def mismatches(settings: dict[str, Any], cfg: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """``{field: (the checkpoint's value, cfg's value)}`` for every model setting that differs
    (optional fields compared by what they resolve to: ``kv_channels`` None is hidden / heads)."""
    out = {}
    for name, value in settings.items():
        ours = getattr(cfg, _RESOLVED.get(name, name))
        if ours != value and not (isinstance(value, float) and isinstance(ours, (int, float)) and float(ours) == value):
            out[name] = (value, ours)
    return out


def flag(name: str, value: Any) -> str:
    """lmfunc's command-line flag that sets model field ``name`` to ``value``."""
    option = "--model." + name.replace("_", "-")
    if isinstance(value, bool):
        return option if value else "--model.no-" + name.replace("_", "-")
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
    if cfg.query_groups != cfg.num_attention_heads:
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
    return arguments


def schedule_mismatches(args: Namespace, settings: dict[str, Any]) -> dict[str, tuple[Any, Any, str]]:
    """Where lmfunc's lr schedule and batch (``settings``: lr, min_lr, lr_decay_style,
    lr_warmup_init, the resolved warmup and decay in iterations, global_batch_size) differ from
    the ones Megatron's ``args`` ran with: ``{name: (Megatron's, lmfunc's, the lmfunc flag that
    sets it to Megatron's)}``. Megatron's decay defaults to its ``train_iters``; a
    ``--lr-warmup-fraction`` is resolved as Megatron does."""
    decay = _get(args, "lr_decay_iters") or _get(args, "train_iters")
    warmup = _get(args, "lr_warmup_iters", 0)
    if _get(args, "lr_warmup_fraction") is not None and decay is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    theirs = {"lr": _get(args, "lr"), "min_lr": _get(args, "min_lr", 0.0), "lr_decay_style": _get(args, "lr_decay_style"),
              "lr_warmup_init": _get(args, "lr_warmup_init", 0.0), "lr_warmup_iters": warmup, "lr_decay_iters": decay,
              "global_batch_size": _get(args, "global_batch_size")}
    options = {"global_batch_size": "--run.global-batch-size"}
    out = {}
    for name, value in theirs.items():
        if value is None or name not in settings:
            continue
        ours = settings[name]
        same = float(ours) == float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else ours == value
        if not same:
            out[name] = (value, ours, f"{options.get(name, '--optim.' + name.replace('_', '-'))} {value}")
    return out
