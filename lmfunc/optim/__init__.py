"""optax-style optimizers: composable ``GradientTransformation``s and Megatron lr schedules."""

from lmfunc.optim.schedules import warmup_decay_schedule
from lmfunc.optim.transforms import (
    EmptyState,
    GradientTransformation,
    ScaleByAdamState,
    ScaleByScheduleState,
    add_decayed_weights,
    adamw,
    apply_updates,
    chain,
    clip_by_global_norm,
    clip_by_global_norm_with_norm,
    constant_schedule,
    decay_mask,
    global_norm,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
)

__all__ = [
    "EmptyState", "GradientTransformation", "ScaleByAdamState", "ScaleByScheduleState",
    "add_decayed_weights", "adamw", "apply_updates", "chain", "clip_by_global_norm",
    "clip_by_global_norm_with_norm", "constant_schedule", "decay_mask", "global_norm",
    "scale_by_adam", "scale_by_learning_rate", "scale_by_schedule", "warmup_decay_schedule",
]
