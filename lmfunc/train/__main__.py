"""``python -m lmfunc.train``: parse the config (YAML, preset, flags) and run the training loop."""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Optional, Sequence

from lmfunc.config.model import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> None:
    from lmfunc.checkpoint.manager import SaveFailed
    from lmfunc.train.cli import parse_args
    from lmfunc.train.loop import train

    try:
        cfg = parse_args(argv)
        train(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except SaveFailed as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as err:
        why = str(err) or "interrupted"
        print(f"error: {why}; the newest complete checkpoint (if any) is kept and the run can be resumed",
              file=sys.stderr)
        raise SystemExit(130) from None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_without_finalizing()


def exit_without_finalizing() -> None:
    """Exit 0 now, skipping interpreter finalization. After a finished multi-process run (process
    group destroyed, logs closed, checkpoints committed), gloo's worker threads can still release
    tensors while the interpreter shuts down; taking the GIL then aborts the process ("terminate
    called without an active exception", SIGABRT), which fails the torchrun launch once in a while
    (see pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # A native crash (a signal in a collective backend's thread, say) prints every thread's Python
    # stack to stderr, so that the rank's last step, phase and line are in the launcher's log.
    faulthandler.enable(all_threads=True)
    main()
