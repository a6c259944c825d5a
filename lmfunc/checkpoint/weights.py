"""Consolidated parameters as one safetensors file, keyed by dotted leaf names (``layers.0.attn.wq``)."""

from __future__ import annotations

from typing import Optional

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmfunc.tree import PyTree, flatten_with_paths, tree_map_with_path


def save_weights(params: PyTree, path: str, metadata: Optional[dict[str, str]] = None) -> None:
    """Write every tensor leaf of ``params`` to the safetensors file ``path`` under its dotted name."""
    tensors = {name: leaf.detach().contiguous().cpu() for name, leaf in flatten_with_paths(params)}
    save_file(tensors, path, metadata=metadata)


def load_weights(path: str, like: PyTree) -> PyTree:
    """The tree ``like`` (tensors or meta tensors giving names, shapes and dtypes) filled from ``path``.

    Raises ``ValueError`` naming the missing, unexpected or mis-shaped tensors.
    """
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights file {path} does not exist") from None
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    expected = dict(flatten_with_paths(like))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{name} {tuple(tensors[name].shape)} (model expects {tuple(expected[name].shape)})"
        for name in sorted(set(expected) & set(tensors)) if tensors[name].shape != expected[name].shape
    ]
    if missing or unexpected or wrong:
        parts = [f"missing: {missing}" if missing else "", f"unexpected: {unexpected}" if unexpected else "",
                 f"wrong shapes: {wrong}" if wrong else ""]
        raise ValueError(f"{path} does not match the model config: " + "; ".join(p for p in parts if p))
    return tree_map_with_path(lambda name, leaf: tensors[name].to(leaf.dtype), like)
