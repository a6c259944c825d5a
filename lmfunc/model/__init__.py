"""The GPT model family as pure functions: ``init``, ``param_axes``, ``forward``, ``logits``;
incremental decoding with a KV cache in ``lmfunc.model.kv_cache``."""

from lmfunc.model.gpt import forward, init, logits, param_axes, param_shapes, param_specs

__all__ = ["forward", "init", "logits", "param_axes", "param_shapes", "param_specs"]
