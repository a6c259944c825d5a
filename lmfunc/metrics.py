"""Throughput accounting with Megatron's formulas (``num_floating_point_operations``).

FLOPs count a forward and backward pass (3x the forward's matmul FLOPs, 2 per multiply-add);
attention's core is counted causally (half of the S x S scores), as Megatron does.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from lmfunc.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_length: int) -> int:
    """Training FLOPs per token of a dense GPT (forward + backward), Megatron's formula.

    ``6 h f c L' + 6 (h (q + 2 d g) + q h) L' + 6 D (3 h + 2 h^2) + 6 h V (D + 1) + 6 q s L'`` with
    q = a d, c = 3 for SwiGLU (gate, up, down) or 2 for GeLU, D MTP depths and L' = L + D (each
    depth is one more layer, its eh_proj and norms, and one more pass through the output head).
    ``V`` is the embedding rows (the padded vocabulary).
    """
    h, d, depths = cfg.hidden_size, cfg.head_dim, cfg.mtp_num_layers
    layers = cfg.num_layers + depths
    q = cfg.num_attention_heads * d
    mlp_matrices = 3 if cfg.activation == "swiglu" else 2
    mlp = 6 * h * cfg.ffn_size * mlp_matrices * layers
    attention_linear = 6 * (h * (q + 2 * d * cfg.query_groups) + q * h) * layers
    attention_core = 6 * q * seq_length * layers
    logits = 6 * h * cfg.vocab_size * (depths + 1)
    mtp_projection = 6 * depths * (3 * h + 2 * h * h)
    return mlp + attention_linear + attention_core + logits + mtp_projection


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_length: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over ``peak_flops``."""
    return tokens_per_second * flops_per_token(cfg, seq_length) / peak_flops


def measure_matmul_peak_flops(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 10,
    threads: Optional[int] = None,
) -> float:
    """Best measured FLOP/s of an ``n x n x n`` matmul on ``device`` (with ``threads`` CPU threads if given).

    Used as the MFU denominator when no peak is configured, so MFU never rests on a guessed constant.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _proc_status_mib(field: str) -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory_stats_mib(device: str | torch.device = "cpu") -> dict[str, float]:
    """Memory in MiB: ``rss``/``peak_rss`` of this process (Linux), and ``cuda_peak`` allocated on CUDA."""
    stats = {}
    for key, field in (("rss", "VmRSS"), ("peak_rss", "VmHWM")):
        value = _proc_status_mib(field)
        if value is not None:
            stats[key] = value
    if "peak_rss" not in stats:
        import resource

        stats["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.device(device).type == "cuda":
        stats["cuda_peak"] = torch.cuda.max_memory_allocated(device) / 2**20
    return stats


class Throughput:
    """Tokens per second since the last ``reset``, with paused time (evaluation) left out."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens, self.since = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def pause(self, seconds: float) -> None:
        self.since += seconds

    def rate(self) -> Optional[float]:
        """None until a timed step has finished."""
        return self.tokens / (time.perf_counter() - self.since) if self.tokens else None
