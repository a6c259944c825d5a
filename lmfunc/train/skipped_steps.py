"""What a run says about steps skipped for non-finite gradients (loss scaling): at the first step
when it overflowed, and at the end when most steps were skipped, with the likely causes."""

from __future__ import annotations

from typing import Optional

from lmfunc.config.train import PrecisionConfig


def first_step_overflow(precision: PrecisionConfig, scale: float, step: int) -> str:
    """The line for a first step that overflowed at loss scale ``scale``."""
    if precision.loss_scale is not None:
        return (f"warning: step {step} overflowed in {precision.compute_dtype} with the static loss scale {scale:g} and "
                "was skipped; a static scale this large skips every such step: lower --precision.loss-scale (2^8 to "
                "2^15 is typical for fp16) or drop it for dynamic scaling")
    return (f"step {step} overflowed at loss scale {scale:g} and was skipped; the dynamic scaler lowers the scale "
            "until steps fit (expected at the start of an fp16 run)")


def mostly_skipped(precision: PrecisionConfig, skipped: int, steps: int) -> Optional[str]:
    """A loud closing warning when at least half of a run's ``steps`` were ``skipped``, else None."""
    if steps <= 0 or skipped * 2 < steps:
        return None
    return (
        f"WARNING: {skipped} of this run's {steps} steps were skipped (non-finite gradients): the model barely "
        f"trained. Likely causes: a static --precision.loss-scale too large for {precision.compute_dtype} (lower it, "
        "or drop it for dynamic scaling); a dynamic scale stuck at --precision.min-loss-scale (the gradients "
        "overflow even unscaled: lower --optim.lr, use --precision.compute-dtype bf16, or check the data); "
        "--optim.lr too high"
    )
