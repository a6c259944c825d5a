"""Probe: does this CPU's low-precision matmul read memory outside its operands?

Run from the repository root on the machine to check (``python -m experiments.probes.onednn_nan``).
Made for the compiled bf16/fp16 NaN that appears only on Intel CPUs with AVX-512 bf16/fp16 (see
``experiments/LOG.md``): on those CPUs torch hands bf16 (and, with avx512_fp16, fp16) ``mm`` to
oneDNN, and oneDNN's brgemm kernels of the version torch 2.13 ships have had K-tail bugs that read
past the valid K columns of an operand (uxlfoundation/oneDNN#5717, #5603). A NaN there, times the
zero padding, poisons otherwise clean outputs.

Part 1 runs ``mm`` on operands that sit inside larger NaN-filled buffers, with the shapes and
strides of the chunked output layer's weight-gradient matmul (``h.t() @ grad_logits``) and a few
other K, and reports every output that is not finite (all inputs in bounds are finite, so any NaN
comes from memory outside the operands). Part 2 runs the TINY compiled train step in bf16 with one
chunk per microbatch, with oneDNN on and off (``torch.backends.mkldnn.flags``), and prints both
gradient norms. On a CPU where torch does not use oneDNN for bf16/fp16 matmuls (AVX2) both parts
report no NaN.
"""

from __future__ import annotations

import dataclasses

import torch

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.train import TrainState, make_train_step
from lmfunc.optim import scale_by_learning_rate


def cpu_summary() -> str:
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = [f for f in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile") if f in flags]
    onednn = next((line.strip() for line in torch.__config__.show().splitlines() if "DNN" in line), "oneDNN: ?")
    return (f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"flags {wanted or 'none of avx512/amx'}; {onednn}")


def padded_operand(rows: int, cols: int, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    """A finite ``[rows, cols]`` operand inside a NaN-filled buffer with room on every side; with
    ``transposed`` it is the ``.t()`` view of a ``[cols, rows]`` block (as ``h.t()`` is)."""
    inner = (cols, rows) if transposed else (rows, cols)
    buffer = torch.full((inner[0] + 64, inner[1] + 64), float("nan"), dtype=dtype)
    block = buffer[32:32 + inner[0], 32:32 + inner[1]]
    block.copy_(torch.randn(inner, dtype=torch.float32).to(dtype))
    return block.t() if transposed else block


def probe_matmuls() -> int:
    """Print the non-finite outputs of each probed matmul; return how many matmuls had any."""
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in ((64, 16, 128), (64, 8, 128), (64, 24, 128), (64, 33, 128), (256, 16, 4096), (64, 128, 64)):
            for a_transposed in (True, False):
                for b_transposed in (False, True):
                    a = padded_operand(m, k, a_transposed, dtype)
                    b = padded_operand(k, n, b_transposed, dtype)
                    out = torch.mm(a, b)
                    count = int((~torch.isfinite(out)).sum())
                    if count:
                        bad += 1
                        print(f"  NaN: {dtype} [{m},{k}] @ [{k},{n}] a.t()={a_transposed} b.t()={b_transposed}: "
                              f"{count} of {out.numel()} outputs")
    print(f"part 1: {bad} matmuls with non-finite outputs from finite operands")
    return bad


def probe_step() -> None:
    cfg = dataclasses.replace(model_preset("tiny"), cross_entropy_chunk_tokens=16)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2, 9))
    batch = {"tokens": tokens[..., :-1], "labels": tokens[..., 1:], "loss_mask": torch.ones(2, 2, 8)}
    for onednn in (True, False):
        with torch.backends.mkldnn.flags(enabled=onednn):
            state = TrainState.create(model.init(cfg, seed=0), scale_by_learning_rate(1.0))
            step = make_train_step(cfg, scale_by_learning_rate(1.0), compute_dtype=torch.bfloat16)
            _, metrics = step(state, batch)
            print(f"part 2: compiled bf16 step, chunk 16, oneDNN {'on ' if onednn else 'off'}: "
                  f"grad_norm {float(metrics['grad_norm']):.5f}")
        torch._dynamo.reset()


if __name__ == "__main__":
    print(cpu_summary())
    probe_matmuls()
    probe_step()
