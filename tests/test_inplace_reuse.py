"""``lmfunc.compiler.inplace_reuse``: Inductor keeps writing kernels' results into a matmul's buffer
when the graph also writes into the matmul's weight (as the donating train step does)."""

import torch
import torch._inductor.config
from torch._inductor.utils import run_and_get_code

from lmfunc.compiler.inplace_reuse import inplace_reuse_despite_input_writes


def _update(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """relu(x @ w) * 2 (a pointwise kernel on a matmul's output), then an SGD-like write into w."""
    z = torch.relu(x @ w) * 2
    out = z @ w.t()
    w.copy_(w - 0.1 * (x.t() @ z))
    return out


def _compile_and_run(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    torch._dynamo.reset()
    compiled = torch.compile(_update, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, (code,) = run_and_get_code(compiled, w, x)
    return out, code


def _pointwise_writes_in_place(code: str) -> bool:
    """Whether the generated relu kernel takes a single buffer (writes into its input)."""
    body = code[code.index("def call("):]
    call = next(line.strip() for line in body.splitlines() if line.strip().startswith("cpp_fused_mul_relu"))
    return call.count(",") == 0


def test_the_pointwise_kernel_writes_into_the_matmul_buffer_and_results_match_eager():
    g = torch.Generator().manual_seed(0)
    w0, x = torch.randn(64, 64, generator=g), torch.randn(128, 64, generator=g)
    w_eager = w0.clone()
    expected = _update(w_eager, x)

    w_plain = w0.clone()
    _, code = _compile_and_run(w_plain, x)
    # torch 2.13's rule: the write into w makes Inductor allocate a new buffer for relu's result.
    # When this fails, Inductor stopped counting ordering-only users and inplace_reuse can go.
    assert not _pointwise_writes_in_place(code), "Inductor now reuses the buffer on its own; drop lmfunc.compiler.inplace_reuse"

    w_fixed = w0.clone()
    with inplace_reuse_despite_input_writes():
        out, code = _compile_and_run(w_fixed, x)
    assert _pointwise_writes_in_place(code)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_fixed, w_eager, rtol=1e-5, atol=1e-5)


def test_the_context_restores_inductors_rule():
    from torch._inductor.scheduler import BaseSchedulerNode

    original = BaseSchedulerNode.decide_inplace_update
    with inplace_reuse_despite_input_writes():
        assert BaseSchedulerNode.decide_inplace_update is not original
    assert BaseSchedulerNode.decide_inplace_update is original
