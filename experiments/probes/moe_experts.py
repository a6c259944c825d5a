"""Probe: the two expert paths of ``lmfunc.model.moe``, dropless (grouped matmuls) against capacity
(static ``[E, C, h]`` buffers), forward and backward, eager and compiled, on this machine.

Workload (``--tokens``, ``--hidden``, ``--ffn``, ``--experts``, ``--topk``): random tokens routed by
a random softmax router, SwiGLU experts; each variant's median time of ``--repeats`` forward +
backward calls after two warm-up calls, its output's relative error against the eager dropless
fp32 result, and the fraction of (token, expert) pairs the capacity path drops. A variant that
fails prints its error instead (e.g. a dtype the grouped matmul lacks).
``python -m experiments.probes.moe_experts [--device cuda] [--tokens 8192 ...]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmfunc.model import moe, router


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x32 = torch.randn(args.tokens, args.hidden, generator=g).to(device)
    logits = torch.randn(args.tokens, args.experts, generator=g).to(device)
    weights32 = [(torch.randn(shape, generator=g) / shape[1] ** 0.5).to(device)
                 for shape in ((args.experts, args.hidden, args.ffn), (args.experts, args.hidden, args.ffn),
                               (args.experts, args.ffn, args.hidden))]
    routing = router.route(logits, args.topk)
    reference = moe.experts_dropless(x32, routing, *weights32)
    print(f"{device} {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''} torch {torch.__version__}; "
          f"T {args.tokens} h {args.hidden} f {args.ffn} E {args.experts} k {args.topk}")

    def dropless(x, *w):
        return moe.experts_dropless(x, routing, *w)

    def capacity(factor):
        slots = moe.expert_capacity(args.tokens, args.experts, args.topk, factor)
        return lambda x, *w: moe.experts_with_capacity(x, routing, *w, capacity=slots)[0]

    variants = {"dropless": dropless, "capacity 1.0": capacity(1.0), "capacity 1.25": capacity(1.25),
                "capacity T (no drops)": lambda x, *w: moe.experts_with_capacity(x, routing, *w, capacity=args.tokens)[0]}
    for factor in (1.0, 1.25):
        slots = moe.expert_capacity(args.tokens, args.experts, args.topk, factor)
        dropped = 1 - float((moe.queue_positions(routing, args.experts, "probs") < slots).float().mean())
        print(f"capacity factor {factor}: {slots} slots per expert, {100 * dropped:.1f}% of the pairs dropped")
    for dtype in (torch.float32, torch.bfloat16):
        for compiled in (False, True):
            for name, fn in variants.items():
                run = torch.compile(fn, fullgraph=True) if compiled else fn
                inputs = [t.to(dtype).requires_grad_() for t in (x32, *weights32)]
                label = f"{str(dtype).removeprefix('torch.'):8s} {'compiled' if compiled else 'eager':8s} {name:22s}"
                try:
                    times = []
                    for i in range(args.repeats + 2):
                        _sync(device)
                        began = time.perf_counter()
                        out = run(*inputs)
                        torch.autograd.grad(out, inputs, torch.ones_like(out))
                        _sync(device)
                        if i >= 2:
                            times.append(time.perf_counter() - began)
                    error = float((out.detach().float() - reference).norm() / reference.norm())
                    print(f"{label} {1e3 * statistics.median(times):9.2f} ms fwd+bwd, rel error {error:.1e}")
                except Exception as exc:  # a path this torch or dtype lacks: say which, go on
                    print(f"{label} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                torch._dynamo.reset()


if __name__ == "__main__":
    main()
