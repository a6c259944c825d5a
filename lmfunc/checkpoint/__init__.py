"""Saving and loading state: sharded DCP checkpoints of any pytree (``sharded``), their directories
(``manager``, ``locate``), HF Llama weights (``hf``), orbax export (``orbax_export``) and consolidated
safetensors weights (``weights``). Nothing here imports ``lmfunc.train``."""

from lmfunc.checkpoint.weights import load_weights, save_weights

__all__ = ["load_weights", "save_weights"]
