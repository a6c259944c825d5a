"""``python -m lmfunc.train``: parse the config (YAML, preset, flags) and run the training loop."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from lmfunc.config.model import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> None:
    from lmfunc.train.cli import parse_args
    from lmfunc.train.loop import train

    try:
        cfg = parse_args(argv)
        train(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
