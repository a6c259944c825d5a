"""The backward's reversed scan, lowered to a loop that indexes backwards (no flipped copies)."""

import torch
from torch import fx
from torch._higher_order_ops.scan import scan
from torch._inductor.utils import fresh_cache

from lmfunc.compiler import compile_step, compiling
from lmfunc.compiler.reversed_scan import FLIPS, SCAN, ReversedScanPass, lower_reversed_scans
from lmfunc.grad import value_and_grad

SEEN: list[dict] = []


class Recording(ReversedScanPass):
    """The pass, noting how many scans it lowered and how many flips and scans were left."""

    def __call__(self, graph: fx.Graph) -> None:
        lowered = lower_reversed_scans(graph.owning_module)
        left = [n.target for n in graph.nodes if n.target in (*FLIPS, SCAN)]
        SEEN.append({"lowered": lowered, "flips": sum(t in FLIPS for t in left), "scans": left.count(SCAN)})


def residual_layers_loss(params: dict, x: torch.Tensor) -> torch.Tensor:
    """``L`` residual layers ``x <- x + (l + 1) tanh(x @ W_l + b_l)`` scanned over the stacked
    ``[L, d, d]`` weights and ``[L, d]`` biases, each layer's row sums also stacked; a loss of both."""

    def body(carry, layer):
        (w, b), index = layer
        out = carry + torch.tanh(carry @ w + b) * (index + 1)
        return out, out.sum(-1)

    layers = params["w"].shape[0]
    last, row_sums = scan(body, x @ params["mix"], ((params["w"], params["b"]), torch.arange(layers)))
    return last.square().mean() + (row_sums * torch.linspace(-1, 1, layers)[:, None]).mean()


def test_reversed_scan_lowering_matches_eager_without_flips(monkeypatch):
    """Compiled with the pass, the backward's scan becomes a backwards loop over the unflipped
    stacked values (no flip left in the graph) and the loss and gradients equal eager's; the
    forward scan's inputs are not flipped, so it is left to Inductor's lowering."""
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 16, 16, generator=generator) / 4, "b": torch.randn(5, 16, generator=generator),
              "mix": torch.eye(16) + torch.randn(16, 16, generator=generator) / 8}
    x = torch.randn(3, 16, generator=generator)
    SEEN.clear()
    monkeypatch.setattr(compiling, "ReversedScanPass", Recording)
    loss_and_grads = value_and_grad(residual_layers_loss)
    with fresh_cache():
        loss, grads = compile_step(loss_and_grads)(params, x)
    expected_loss, expected = loss_and_grads(params, x)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-5)
        assert float(grads[name].abs().max()) > 0.1
    step_graphs = [seen for seen in SEEN if seen["lowered"] or seen["scans"]]  # not the scan bodies
    assert step_graphs == [{"lowered": 1, "flips": 0, "scans": 1}]
