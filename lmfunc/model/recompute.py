"""Activation recompute (Megatron's ``recompute_granularity``), usable eagerly and compiled.

``checkpointed(fn)`` wraps a pure function in non-reentrant ``torch.utils.checkpoint``: eagerly,
the backward pass re-runs ``fn`` instead of keeping its intermediates; under ``torch.compile``
the ops inside ``fn`` are tagged "recompute" and ``lmfunc.compiler.recompute_pass`` duplicates them into each
backward region of the one compiled train step. With gradients off (evaluation, generation) the
function runs plainly. Recomputation is exact: lmfunc's dropout is a pure function of its seed.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch
import torch.utils.checkpoint

F = TypeVar("F", bound=Callable)


def checkpointed(fn: F) -> F:
    """``fn`` with its intermediates recomputed in the backward pass instead of stored."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped
