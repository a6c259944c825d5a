"""``python -m lmfunc.export``: a training checkpoint's weights as safetensors, HF Llama or orbax.

Reads the params of one checkpoint (any mesh it was saved on) on a single process and writes:

- ``safetensors``: ``OUT/model.safetensors`` (dotted lmfunc names) + ``OUT/config.yaml``, a directory
  that ``python -m lmfunc.generate --run OUT`` reads;
- ``hf``: ``OUT/model.safetensors`` + ``OUT/config.json`` for ``transformers.LlamaForCausalLM``;
- ``orbax``: an orbax PyTree checkpoint of numpy arrays (needs ``pip install 'lmfunc[orbax]'``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Literal, Optional, Sequence

import torch
import tyro

from lmfunc import model
from lmfunc.checkpoint.locate import CONFIG_FILE, find_step_dir, saved_config
from lmfunc.checkpoint.sharded import load_tree
from lmfunc.config.model import ConfigError
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import save_config
from lmfunc.precision import DTYPES
from lmfunc.tree import PyTree, tree_map


@dataclasses.dataclass(frozen=True)
class ExportArgs:
    """Export the weights of a training checkpoint."""

    checkpoint: str
    """A run directory, a checkpoint save_dir or one iter_NNNNNNN/ directory."""
    out: str
    """Output directory."""
    format: Literal["safetensors", "hf", "orbax"] = "safetensors"
    """safetensors (lmfunc names + config.yaml), hf (Llama layout + config.json) or orbax."""
    step: Optional[int] = None
    """The checkpoint step to export; None takes the newest."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of the written weights."""


def load_params(checkpoint: str, step: Optional[int] = None) -> tuple[TrainConfig, PyTree, str]:
    """(saved config, full params, step directory) of a checkpoint, read on this one process."""
    step_dir = find_step_dir(checkpoint, step)
    cfg = saved_config(step_dir)
    like = {"params": tree_map(lambda m: torch.empty(m.shape, dtype=m.dtype), model.param_shapes(cfg.model))}
    return cfg, load_tree(like, step_dir, allow_unused=True)["params"], step_dir


def export(args: ExportArgs) -> str:
    """Write the export and return a one-line summary."""
    cfg, params, step_dir = load_params(args.checkpoint, args.step)
    dtype = DTYPES[args.dtype]
    if args.format == "hf":
        from lmfunc.checkpoint.hf import save_llama

        save_llama(params, cfg.model, args.out, dtype)
    elif args.format == "orbax":
        from lmfunc.checkpoint.orbax_export import save_orbax

        save_orbax(tree_map(lambda x: x.to(dtype), params), args.out)
    else:
        from lmfunc.checkpoint import save_weights

        os.makedirs(args.out, exist_ok=True)
        save_weights(tree_map(lambda x: x.to(dtype), params), os.path.join(args.out, "model.safetensors"),
                     {"source": step_dir})
        save_config(cfg, os.path.join(args.out, CONFIG_FILE))
    return f"exported {step_dir} as {args.format} ({args.dtype}) to {args.out}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = tyro.cli(ExportArgs, args=argv, prog="python -m lmfunc.export")
    try:
        print(export(args))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
