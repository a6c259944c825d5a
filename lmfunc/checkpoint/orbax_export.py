"""Consolidated weights as an orbax checkpoint, for JAX users (optional: ``pip install 'lmfunc[orbax]'``).

The parameter tree keeps its nested-dict structure; leaves become numpy arrays on one host (bf16
through ``ml_dtypes.bfloat16``). Never used on the training path: orbax needs JAX and knows
nothing of torch or DTensor.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from lmfunc.config.model import ConfigError
from lmfunc.tree import PyTree, tree_map


def _numpy(leaf: torch.Tensor) -> np.ndarray:
    leaf = leaf.detach().cpu().contiguous()
    if leaf.dtype == torch.bfloat16:
        import ml_dtypes

        return leaf.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return leaf.numpy()


def to_numpy_tree(params: PyTree) -> PyTree:
    """The same tree with numpy leaves (bf16 as ``ml_dtypes.bfloat16``)."""
    return tree_map(_numpy, params)


def save_orbax(params: PyTree, directory: str) -> None:
    """Write ``params`` with ``orbax.checkpoint.PyTreeCheckpointer`` to ``directory`` (must not exist)."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ConfigError("--format orbax needs orbax-checkpoint (it pulls in JAX, about 0.5 GB): "
                          "pip install 'lmfunc[orbax]'") from None
    if os.path.exists(directory):
        raise ConfigError(f"{directory} already exists; orbax writes a new directory: remove it or pick another --out")
    ocp.PyTreeCheckpointer().save(os.path.abspath(directory), to_numpy_tree(params))
