"""``python -m lmfunc.plan``: the memory and FLOPs plan of a run, before running it.

Takes the same ``--config``, ``--preset`` and flags as ``python -m lmfunc.train``, plus
``--world-size N`` (default: the product of the parallel sizes, or torchrun's WORLD_SIZE).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from lmfunc.config.model import ConfigError

DESCRIPTION = """Print the plan of a training run: Megatron-LM's theoretical parameters, memory and FLOPs
(exactly as Megatron computes them), and lmfunc's own per-rank memory prediction. Accepts every
setting of `python -m lmfunc.train`; every layout (dp_replicate, dp_shard, tp, pp, cp, ep) trains,
with dense, MoE and MLA models. Model settings Megatron has but lmfunc's model does not build (MLA
with QK-norm, linear biases or learned positions; MoE with non-SwiGLU experts, linear biases or
scan_layers) are planned with Megatron's formulas and marked "not trainable yet". Besides the training
flags below: --world-size N (default: the product of the parallel sizes, or torchrun's WORLD_SIZE
when a size is -1)."""


def main(argv: Optional[Sequence[str]] = None) -> None:
    from lmfunc.plan.report import format_plan, make_plan, world_size_for
    from lmfunc.config.command_line import parse_config

    try:
        cfg, known = parse_config(argv, "python -m lmfunc.plan", DESCRIPTION, extra=[
            ("--world-size", dict(type=int, default=None))])
        world_size = world_size_for(cfg, known.world_size)
        cfg = cfg.validate(world_size, planning=True)
        print(format_plan(make_plan(cfg, world_size)))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
