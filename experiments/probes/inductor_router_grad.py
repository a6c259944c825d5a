"""The Inductor scheduling bug that dropped part of the MoE router's gradient (torch 2.13, CPU;
experiments/LOG.md, 2026-11-27 "expert parallelism; an Inductor scheduling bug").

A router as lmfunc wrote it before ``router.take``: fp32 sigmoid scores, the top-k *values* as the
routing weights, SwiGLU experts, and the load-balancing loss over the same logits attached with
``attach_aux_loss``. Compiled by Inductor, the router weight's gradient differs from eager's: a
kernel reads the top-k backward's zero-filled gradient buffer before the kernel that scatters
into it runs. ``python -m experiments.probes.inductor_router_grad`` prints the relative error per
backend (a correct compile: ~1e-7, the fp32 routing); ``--take`` uses ``router.take`` for the weights.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from lmfunc.grad import attach_aux_loss, value_and_grad
from lmfunc.model import router


def main(take: bool) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden, experts, ffn, topk = 12, 8, 4, 6, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=g)
    w = torch.randn(hidden, experts, dtype=torch.float64, generator=g)
    w_gate, w_up = (torch.randn(experts, hidden, ffn, dtype=torch.float64, generator=g) for _ in range(2))
    w_down = torch.randn(experts, ffn, hidden, dtype=torch.float64, generator=g)
    cotangent = torch.randn(tokens, hidden, dtype=torch.float64, generator=g)

    def objective(w, x):
        logits = x @ w
        scores = torch.sigmoid(logits.float())
        if take:
            chosen = scores.detach().topk(topk, dim=-1).indices
            weights = router.take(scores, chosen)
        else:
            weights, chosen = scores.topk(topk, dim=-1)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        dense = torch.stack([F.silu(x @ w_gate[e]) * (x @ w_up[e]) @ w_down[e] for e in range(experts)], 1)
        out = (dense.gather(1, chosen[:, :, None].expand(tokens, topk, hidden)) * weights[:, :, None].double()).sum(1)
        aux_scores, routed = router.aux_loss_scores(logits, topk, "sigmoid")
        balance = router.balancing_loss_of_sums(aux_scores.sum(0), routed.float().sum(0), tokens, topk, 1.0)
        out = attach_aux_loss(out, balance * 0.1, torch.tensor(0.37, dtype=torch.float64))
        return (out * cotangent).sum()

    grad = value_and_grad(objective)
    _, want = grad(w, x)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            _, got = torch.compile(grad, fullgraph=True, backend=backend)(w, x)
            print(f"{backend:>10}: relative error of the router weight's gradient "
                  f"{float((got - want).norm() / want.norm()):.2e}")


if __name__ == "__main__":
    main(take="--take" in sys.argv)
