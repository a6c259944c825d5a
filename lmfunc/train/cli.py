"""Command-line parsing of ``python -m lmfunc.train``: YAML defaults, a model preset, tyro flags."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import tyro

from lmfunc.config.model import MODEL_PRESETS
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import load_config
from lmfunc.parallel.mesh import launched_world_size

DESCRIPTION = f"""Train a GPT model with lmfunc.

Settings come from, in increasing priority: the built-in defaults; --preset NAME (a model preset:
{", ".join(MODEL_PRESETS)}); --config FILE.yaml (sections model:, data:, optim:, run: ...; ${{ENV}}
references allowed; a top-level `preset:` key works like --preset); the flags below. With no data
flag the run trains on the embedded corpus (Python's reference topics, shipped with Python).
"""


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """The validated ``TrainConfig`` for command-line arguments ``argv`` (default ``sys.argv[1:]``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--preset", default=None)
    known, rest = pre.parse_known_args(args)
    base = load_config(known.config, known.preset)
    cfg = tyro.cli(TrainConfig, default=base, args=rest, description=DESCRIPTION, prog="python -m lmfunc.train")
    return cfg.validate(launched_world_size())
