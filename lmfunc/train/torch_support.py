"""What the installed torch cannot run, refused when a run starts, in one line that names the torch
that can (never a traceback from inside a compile, never other numbers)."""

from __future__ import annotations

from lmfunc.compiler.torch_compat import too_old_message
from lmfunc.compiler.torch_compat.tracing import TRACES_AUTOGRAD_GRAD
from lmfunc.config.model import ConfigError, ModelConfig

EAGER_HINT = "; or run it eagerly (--run.no-compile)"


def compile_refusal(model: ModelConfig, world_size: int, compile: bool) -> str | None:
    """Why this torch cannot compile the step of ``model`` on ``world_size`` ranks, or None.

    Before torch 2.13 Dynamo cannot trace ``torch.autograd.grad`` into the step's graph, so a
    compiled step differentiates with ``torch.func`` (``lmfunc.grad``), which sees no DTensor (any
    mesh: more than one rank) and no custom op's autograd (dropless MoE's grouped matmul)."""
    if not compile or TRACES_AUTOGRAD_GRAD:
        return None
    if world_size > 1:
        return too_old_message(2, 13, f"a compiled step on a DTensor mesh ({world_size} ranks)") + EAGER_HINT
    if any(model.moe_layers) and model.moe_expert_capacity_factor is None:
        return (too_old_message(2, 13, "a compiled dropless MoE step (the grouped matmul's autograd)")
                + "; or set model.moe_expert_capacity_factor" + EAGER_HINT)
    return None


def refuse_what_this_torch_cannot(model: ModelConfig, world_size: int, compile: bool) -> None:
    """Raise ``ConfigError`` with ``compile_refusal``'s line, if any."""
    refusal = compile_refusal(model, world_size, compile)
    if refusal is not None:
        raise ConfigError(refusal)
