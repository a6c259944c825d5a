"""Throughput and memory measurements: the MFU denominator (a measured matmul peak), process and
device memory, tokens per second. The FLOPs numerator is Megatron's count (``lmfunc.plan.megatron``)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")



GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, per GPU. Keys are matched
    # against torch.cuda.get_device_name(), most specific first.
    "H100 PCIe": {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "H100": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    "H200": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "tf32": 183.2e12, "fp32": 91.6e12},
}
"""Peak FLOP/s by GPU model and math: ``bf16`` (also fp16), ``tf32`` (fp32 with TF32), ``fp32``."""


def table_peak_flops(device_name: str, compute_dtype: str, tf32: bool) -> Optional[tuple[float, str]]:
    """The datasheet peak for a GPU named ``device_name`` computing in ``compute_dtype`` ('fp32',
    'bf16', 'fp16'; fp32 with ``tf32`` uses the TF32 peak), and the table entry used; None for a
    GPU not in ``GPU_PEAK_FLOPS``."""
    math = "bf16" if compute_dtype in ("bf16", "fp16") else "tf32" if tf32 else "fp32"
    for key, peaks in GPU_PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return peaks[math], f"{key} {math} datasheet peak"
    return None


def peak_flops(device: torch.device, compute_dtype: str, tf32: bool, configured: Optional[float]) -> tuple[float, str]:
    """The MFU denominator of one process and where it comes from: ``configured`` (log.peak_flops),
    else on cuda the datasheet table (``table_peak_flops``), else a measured matmul peak in the
    compute dtype's math (fp32 on the CPU, as the CPU's low-precision matmuls are no faster)."""
    if configured is not None:
        return configured, "configured (log.peak_flops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = table_peak_flops(name, compute_dtype, tf32)
        if found is not None:
            return found[0], f"{found[1]} ({name})"
        dtype = torch.bfloat16 if compute_dtype in ("bf16", "fp16") else torch.float32
        return measure_matmul_peak_flops(device, dtype, n=8192), f"measured {dtype} matmul ({name} is not in the table)"
    return measure_matmul_peak_flops(), "measured fp32 matmul"


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


def allocator_peak_bytes(fn: Callable[[], T], device: str | torch.device = "cpu") -> tuple[T, int]:
    """``fn()`` and the peak bytes torch's allocator held during it above what it held before.

    On cuda: ``torch.cuda.max_memory_allocated`` after a reset. On the CPU, which has no allocator
    statistics: the profiler's memory events (every allocation and free of a CPU tensor, those made
    inside compiled code included), read from its trace.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return result, 0
    # "Total Allocated" is the profiler's running count since the process first profiled memory:
    # bytes allocated while an earlier profiler was active and freed after it stopped are never
    # taken off. The count just before this call's first event is the baseline.
    baseline = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return result, max(0, max(e["args"]["Total Allocated"] for e in memory) - baseline)


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
    """Memory in MiB: ``rss``/``peak_rss`` of this process (Linux), and on CUDA the caching
    allocator's peaks: ``cuda_peak_allocated`` (tensors) and ``cuda_peak_reserved`` (held blocks)."""
    stats = {}
    for key, field in (("rss", "VmRSS"), ("peak_rss", "VmHWM")):
        value = _proc_status_mib(field)
        if value is not None:
            stats[key] = value
    if "peak_rss" not in stats:
        import resource

        stats["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.device(device).type == "cuda":
        stats["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device) / 2**20
        stats["cuda_peak_reserved"] = torch.cuda.max_memory_reserved(device) / 2**20
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
