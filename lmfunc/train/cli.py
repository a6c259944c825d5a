"""Command-line parsing of ``python -m lmfunc.train``: YAML defaults, a model preset, tyro flags."""

from __future__ import annotations

from typing import Optional, Sequence

from lmfunc.config.command_line import parse_config
from lmfunc.config.model import MODEL_PRESETS
from lmfunc.config.train import TrainConfig
from lmfunc.parallel.mesh import launched_world_size

DESCRIPTION = f"""Train a GPT model with lmfunc.

Settings come from, in increasing priority: the built-in defaults; --preset NAME (a model preset:
{", ".join(MODEL_PRESETS)}); --config FILE.yaml (sections model:, data:, optim:, run: ...; ${{ENV}}
references allowed; a top-level `preset:` key works like --preset); the flags below. With no data
flag the run trains on the embedded corpus (Python's reference topics, shipped with Python).
"""


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """The validated ``TrainConfig`` for command-line arguments ``argv`` (default ``sys.argv[1:]``)."""
    cfg, _ = parse_config(argv, "python -m lmfunc.train", DESCRIPTION)
    return cfg.validate(launched_world_size())
