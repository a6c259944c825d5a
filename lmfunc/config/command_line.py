"""A ``TrainConfig`` from a command line: defaults, ``--preset``, ``--config`` YAML, then tyro flags
(shared by ``python -m lmfunc.train`` and ``python -m lmfunc.plan``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import tyro

from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import load_config


def parse_config(argv: Optional[Sequence[str]], prog: str, description: str,
                 extra: Sequence[tuple[str, dict]] = ()) -> tuple[TrainConfig, argparse.Namespace]:
    """The (unvalidated) ``TrainConfig`` of ``argv``: defaults, then ``--preset``, then ``--config``
    YAML, then tyro flags; with the values of the ``extra`` options (argparse ``(flag, kwargs)``
    pairs, parsed before the tyro flags)."""
    args = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--preset", default=None)
    for flag, kwargs in extra:
        pre.add_argument(flag, **kwargs)
    known, rest = pre.parse_known_args(args)
    base = load_config(known.config, known.preset)
    return tyro.cli(TrainConfig, default=base, args=rest, description=description, prog=prog), known
