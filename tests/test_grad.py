import pytest
import torch
import torch._dynamo.testing

from lmfunc import value_and_grad
from lmfunc.compiler import tracing_settings


def quadratic(params, x):
    y = (params["w"] @ x + params["b"]).pow(2).sum()
    return y, {"y": y * 2}


def test_value_and_grad_matches_closed_form():
    w, b, x = torch.randn(3, 4), torch.randn(3), torch.randn(4)
    (value, aux), grads = value_and_grad(quadratic, has_aux=True)({"w": w, "b": b}, x)
    residual = w @ x + b
    torch.testing.assert_close(value, residual.pow(2).sum())
    torch.testing.assert_close(aux["y"], 2 * value)
    torch.testing.assert_close(grads["b"], 2 * residual)
    torch.testing.assert_close(grads["w"], 2 * torch.outer(residual, x))
    assert not value.requires_grad and not grads["w"].requires_grad


def test_unused_leaves_get_zeros_and_integer_leaves_get_none():
    params = {"w": torch.randn(3), "unused": torch.randn(2), "ids": torch.arange(3)}
    value, grads = value_and_grad(lambda p: (p["w"] * p["ids"]).sum())(params)
    torch.testing.assert_close(grads["w"], torch.arange(3.0))
    torch.testing.assert_close(grads["unused"], torch.zeros(2))
    assert grads["ids"] is None


def test_non_scalar_value_is_a_clear_error():
    with pytest.raises(TypeError, match="scalar tensor"):
        value_and_grad(lambda p: p["w"] * 2)({"w": torch.randn(3)})


def test_compiles_to_one_graph_with_autograd_grad():
    """Pins the private torch._dynamo.config.trace_autograd_ops path (``tracing_settings``): fails
    if it stops tracing."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    grad_fn = torch.compile(value_and_grad(quadratic, has_aux=True), fullgraph=True, backend=counter)
    params, x = {"w": torch.randn(3, 4), "b": torch.randn(3)}, torch.randn(4)
    with tracing_settings():
        (value, _), grads = grad_fn(params, x)
        grad_fn(params, x + 1)
    (ref_value, _), ref_grads = value_and_grad(quadratic, has_aux=True)(params, x)
    assert counter.frame_count == 1
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grads["w"], ref_grads["w"])
