"""Slice copies in scan bodies rewritten into a slice and a copy that Inductor fuses."""

import torch
from torch._higher_order_ops.scan import scan
from torch._inductor.utils import fresh_cache

from lmfunc.compiler import compile_step
from lmfunc.grad import value_and_grad


def rotated_layers_loss(params: dict, x: torch.Tensor) -> torch.Tensor:
    """``L`` layers scanned over stacked ``[L, d, d]`` weights, each rotating the halves of its
    projection as RoPE does (``cat(-second, first)`` of ``[..., :d/2]`` and ``[..., d/2:]``)."""

    def body(carry, w):
        h = carry @ w
        half = h.shape[-1] // 2
        rotated = torch.cat([-h[..., half:], h[..., :half]], dim=-1)
        out = carry + torch.tanh(h * 0.5 + rotated)
        return out, out.new_zeros(())

    last, _ = scan(body, x, params["w"])
    return last.square().mean()


def test_a_scanned_body_runs_no_slice_copy_and_keeps_its_gradients():
    """The compiled step calls no ``aten::slice_copy`` (AOTAutograd's copies of the body's slices,
    which Inductor would otherwise run as separate calls on every iteration; 4 per call here
    without the pass), and its loss and gradients equal eager's."""
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 16, 16) * 0.3}
    x = torch.randn(6, 16)
    eager_loss, eager_grads = value_and_grad(rotated_layers_loss)(params, x)
    with fresh_cache():
        step = compile_step(value_and_grad(rotated_layers_loss))
        step(params, x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss, grads = step(params, x)
    calls = [event.name for event in prof.events()]
    assert "aten::slice_copy" not in calls and any(name == "aten::mm" for name in calls)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads["w"], eager_grads["w"], rtol=1e-5, atol=1e-6)
