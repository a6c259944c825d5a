"""JAX-style ``value_and_grad`` for functions of parameter pytrees.

Implementation choice (see docs/architecture.md): gradients come from ``torch.autograd.grad``
on fresh leaves made with ``detach().requires_grad_(True)``. ``torch.func.grad_and_value``
would be the obvious choice, but it wraps its inputs and hides the DTensor API
(``.placements``, ``.redistribute``; pytorch#134462), which lmfunc's parallelism needs.
``torch.autograd.grad`` works for plain tensors and DTensors alike and traces inside
``torch.compile(fullgraph=True)`` while Dynamo's ``trace_autograd_ops`` is on (torch 2.13+) — a
private flag that ``lmfunc.compiler.compile_step`` turns on while it traces (never globally).
``tests/test_grad.py`` fails if that stops compiling. On older torch a compiled function
differentiates with ``torch.func.grad_and_value`` instead (plain tensors only).

``attach_aux_loss`` adds an auxiliary loss to the gradient of a function that returns something else.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch.distributed.tensor import DTensor, Replicate

from lmfunc.compiler.torch_compat import TorchTooOld, too_old_message
from lmfunc.compiler.torch_compat.tensors import pytree
from lmfunc.compiler.torch_compat.tracing import TRACES_AUTOGRAD_GRAD
from lmfunc.tree import PyTree, tree_leaves, tree_map, tree_unflatten_as


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _grad_by_torch_func(fn: Callable, args: tuple, kwargs: dict, argnum: int, has_aux: bool, leaves: list,
                        differentiable: list[bool], check_scalar: Callable) -> tuple[Any, Any, list]:
    """``(value, aux, grads of the differentiable leaves)`` by ``torch.func.grad_and_value``: how a
    compiled step differentiates on torch older than 2.13, whose Dynamo cannot trace
    ``torch.autograd.grad`` on fresh leaves. ``torch.func`` hides the DTensor API and custom ops'
    autograd, so this serves plain tensors without custom ops (a compiled step on a mesh, or with
    dropless MoE's grouped matmul, is refused on such torch before it is traced:
    ``lmfunc.train.step``). ``torch.func`` takes only tensors as aux, so the aux's other leaves pass
    around it."""
    if any(isinstance(x, DTensor) for x in leaves):
        raise TorchTooOld(too_old_message(2, 13, "a compiled step over DTensor parameters"))
    aux_layout: dict[str, Any] = {}

    def of_differentiable(wrt: list) -> tuple[torch.Tensor, list]:
        it = iter(wrt)
        new_args = list(args)
        new_args[argnum] = tree_unflatten_as(args[argnum], [next(it) if diff else x for x, diff in zip(leaves, differentiable)])
        out = fn(*new_args, **kwargs)
        value, aux = out if has_aux else (out, None)
        check_scalar(value)
        aux_layout["leaves"], aux_layout["spec"] = pytree.tree_flatten(aux)
        return value, [x for x in aux_layout["leaves"] if isinstance(x, torch.Tensor)]

    wrt = [x for x, diff in zip(leaves, differentiable) if diff]
    grads_wrt, (value, aux_tensors) = torch.func.grad_and_value(of_differentiable, has_aux=True)(wrt)
    aux_iter = iter(aux_tensors)
    aux = pytree.tree_unflatten([next(aux_iter) if isinstance(x, torch.Tensor) else x for x in aux_layout["leaves"]],
                                aux_layout["spec"])
    return value, aux, grads_wrt


def value_and_grad(
    fn: Callable[..., Any], argnum: int = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, PyTree]]:
    """Return ``f(*args) -> (value, grads)`` (``((value, aux), grads)`` with ``has_aux``).

    ``fn`` must return a scalar tensor (or ``(scalar, aux)`` with ``has_aux``). ``grads`` is a
    pytree shaped like ``args[argnum]``: floating-point leaves get their gradient (zeros where
    the value does not depend on them), other leaves come back as ``None``. The value and
    aux are detached. Works eagerly and compiled (``lmfunc.compiler.compile_step``).
    """

    def check_scalar(value: Any) -> None:
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise TypeError(
                "value_and_grad: the function must return a scalar tensor"
                + (" as the first element of (value, aux)" if has_aux else "")
                + f", got {type(value).__name__}"
                + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
            )

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PyTree]:
        leaves = tree_leaves(args[argnum])
        differentiable = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves]
        if not TRACES_AUTOGRAD_GRAD and torch.compiler.is_compiling():
            value, aux, grads_wrt = _grad_by_torch_func(fn, args, kwargs, argnum, has_aux, leaves, differentiable,
                                                        check_scalar)
        else:
            inputs = [
                x.detach().requires_grad_(True) if diff else x for x, diff in zip(leaves, differentiable)
            ]
            new_args = list(args)
            new_args[argnum] = tree_unflatten_as(args[argnum], inputs)
            with torch.enable_grad():
                out = fn(*new_args, **kwargs)
                value, aux = out if has_aux else (out, None)
                check_scalar(value)
                wrt = [x for x, diff in zip(inputs, differentiable) if diff]
                grads_wrt = torch.autograd.grad(value, wrt, allow_unused=True, materialize_grads=True)
        grad_iter = iter(grads_wrt)
        grads = tree_unflatten_as(args[argnum], [next(grad_iter) if diff else None for diff in differentiable])
        value = value.detach()
        if has_aux:
            return (value, tree_map(_detach, aux)), grads
        return value, grads

    return wrapped


# ----------------------------------------------------------------------------- auxiliary losses
class _AttachAuxLoss(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, aux_loss, scale = inputs
        ctx.save_for_backward(scale)
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        ctx.aux_mesh = aux_loss.device_mesh if isinstance(aux_loss, DTensor) else None

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor):
        (scale,) = ctx.saved_tensors
        if isinstance(scale, DTensor):
            scale = scale.to_local()
        device = grad_x.to_local().device if isinstance(grad_x, DTensor) else grad_x.device
        grad_aux = torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=device) * scale.to(ctx.aux_dtype)
        if ctx.aux_mesh is not None:  # a loss on a mesh gets its gradient whole on every rank
            grad_aux = DTensor.from_local(grad_aux, ctx.aux_mesh, [Replicate()] * ctx.aux_mesh.ndim)
        return grad_x, grad_aux, None


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, scale: Union[torch.Tensor, float] = 1.0) -> torch.Tensor:
    """``x`` unchanged; in the backward ``aux_loss`` receives the gradient ``scale`` (elementwise),
    as if ``scale * aux_loss`` had been added to the objective: how an auxiliary loss (multi-token
    prediction, the MoE router's losses) joins the main graph, as Megatron's ``MTPLossAutoScaler``
    and ``MoEAuxLossAutoScaler`` do. ``scale`` is a tensor (the loss scale times the step's
    normalisation), so changing it never recompiles. Written in the ``setup_context`` style with
    ``generate_vmap_rule``, the form that works under ``torch.func``, ``autograd.grad`` and
    ``torch.compile(fullgraph=True)`` alike (``tests/test_mtp.py`` compiles it with ``autograd.grad``).

    ``x``: any tensor on the path to the main loss (Megatron uses the final hidden states).
    ``aux_loss``: a tensor (usually a scalar) that depends on the parameters; a DTensor must be
    whole on every rank (``Replicate``), and its gradient is.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=aux_loss.device)
    return _AttachAuxLoss.apply(x, aux_loss, scale)
