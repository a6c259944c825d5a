"""``python -m lmfunc.export``: a training checkpoint's weights as safetensors, HF Llama or orbax.

Reads the params of one checkpoint (any mesh it was saved on) on a single process and writes:

- ``safetensors``: ``OUT/model.safetensors`` (dotted lmfunc names) + ``OUT/config.yaml``, a directory
  that ``python -m lmfunc.generate --run OUT`` reads;
- ``hf``: ``OUT/model.safetensors`` + ``OUT/config.json`` for ``transformers.LlamaForCausalLM`` (or
  ``Qwen3MoeForCausalLM`` for a mixture-of-experts model);
- ``orbax``: an orbax PyTree checkpoint of numpy arrays (needs ``pip install 'lmfunc[orbax]'``);
- ``megatron``: a Megatron-LM ``torch_dist`` checkpoint, ``OUT/release/`` with its tracker file, that
  megatron-core loads into a ``GPTModel`` built from the arguments printed and written to
  ``OUT/megatron_args.txt`` (``lmfunc.checkpoint.megatron``), at any TP/PP layout.
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
from lmfunc.checkpoint.sharded import DamagedCheckpoint, load_tree
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
    format: Literal["safetensors", "hf", "orbax", "megatron"] = "safetensors"
    """safetensors (lmfunc names + config.yaml), hf (Llama, or Qwen3-MoE with experts, + config.json), orbax, or
    megatron (a torch_dist checkpoint + the Megatron arguments of the model)."""
    step: Optional[int] = None
    """The checkpoint step to export; None takes the newest."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of the written weights."""
    overwrite: bool = False
    """Write into a non-empty --out (replacing only the files the export writes); a folder that
    holds a training run is refused even then."""


RUN_MARKERS = ("log.jsonl", "checkpoints", "lmfunc.lock")
"""Entries that make a folder a training run's (``python -m lmfunc.train``)."""


def check_out_dir(out: str, overwrite: bool, format: str) -> None:
    """Raise ``ConfigError`` unless ``out`` may be written: missing or empty, or non-empty with
    ``overwrite`` (not for orbax, which writes a new directory). Never a folder holding a run or a
    checkpoint: the export would replace its files."""
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise ConfigError(f"--out {out} is a file; pick a folder path")
    entries = os.listdir(out)
    run = [name for name in RUN_MARKERS if name in entries] + [name for name in entries if name.startswith("iter_")]
    if run:
        raise ConfigError(f"--out {out} holds a training run or checkpoints ({', '.join(sorted(run))}); "
                          "an export never writes there, with or without --overwrite: pick another --out")
    if entries and (not overwrite or format == "orbax"):
        how = "orbax writes a new directory" if format == "orbax" else "pass --overwrite to replace the exported files"
        raise ConfigError(f"--out {out} is not empty ({len(entries)} entries, e.g. {sorted(entries)[0]}); "
                          f"pick a new folder, or {how}")


def load_params(checkpoint: str, step: Optional[int] = None) -> tuple[TrainConfig, PyTree, str]:
    """(saved config, full params, step directory) of a checkpoint, read on this one process."""
    step_dir = find_step_dir(checkpoint, step)
    cfg = saved_config(step_dir)
    like = {"params": tree_map(lambda m: torch.empty(m.shape, dtype=m.dtype), model.param_shapes(cfg.model))}
    return cfg, load_tree(like, step_dir, allow_unused=True)["params"], step_dir


def export(args: ExportArgs) -> str:
    """Write the export (after checking ``args.out``) and return a one-line summary."""
    check_out_dir(args.out, args.overwrite, args.format)
    cfg, params, step_dir = load_params(args.checkpoint, args.step)
    dtype = DTYPES[args.dtype]
    if args.format == "hf":
        from lmfunc.checkpoint.hf import save_hf

        save_hf(params, cfg.model, args.out, dtype)
    elif args.format == "orbax":
        from lmfunc.checkpoint.orbax_export import save_orbax

        save_orbax(tree_map(lambda x: x.to(dtype), params), args.out)
    elif args.format == "megatron":
        from lmfunc.checkpoint.megatron import ARGUMENTS_FILE, save_megatron

        save_megatron(params, cfg.model, args.out, dtype=dtype, overwrite=args.overwrite)
        with open(os.path.join(args.out, ARGUMENTS_FILE)) as f:
            arguments = f.read()
        return (f"exported {step_dir} as megatron ({args.dtype}) to {args.out}; the model's Megatron arguments "
                f"({os.path.join(args.out, ARGUMENTS_FILE)}):\n{arguments}")
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
    except (ConfigError, ValueError, FileNotFoundError, DamagedCheckpoint) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
