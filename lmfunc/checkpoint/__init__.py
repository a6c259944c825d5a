"""Saving and loading state: consolidated weights as safetensors (``lmfunc.checkpoint.weights``)."""

from lmfunc.checkpoint.weights import load_weights, save_weights

__all__ = ["load_weights", "save_weights"]
