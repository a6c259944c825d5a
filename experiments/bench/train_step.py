"""``python -m experiments.bench``: train-step throughput of lmfunc's functional step vs an nn.Module baseline.

Variants (each run in its own process, alternated across repeats because this box is noisy):
  func-eager       lmfunc ``make_train_step(compile=False, donate_state=True)``
  func-compiled    lmfunc ``make_train_step(donate_state=True)``: one torch.compile(fullgraph) graph
                   (the state donated, as ``python -m lmfunc.train`` runs it; ``--no-donate`` not)
  func-scan        the same with ``model.scan_layers`` (blocks stacked, run by torch's scan; not
                   among the default variants)
  module-eager     the same model as an nn.Module, ``loss.backward()``, clip, ``torch.optim.AdamW(fused)``
  module-compiled  the same with ``torch.compile(model)`` and ``torch.compile(optimizer.step)``
All variants start from the same weights and train on the same batch, so their first losses match.
Reports tokens/s and ms/step (medians), MFU against a measured fp32 matmul peak, peak memory of the
worker process (compilation included), step memory (how far memory rises above its resting level
during the timed steps) and compile time (first step minus a steady step, with a fresh Inductor
cache, so it is a cold compile; with ``--warm-cache`` it is the time to load the cached graphs).
Memory is the process's RSS on ``--device cpu`` (exact tensor accounting with ``--memory-mode``)
and the CUDA caching allocator's allocated bytes on ``--device cuda``.
``--paired`` compares speed only, with the variants' steps run in turn inside one process and
each judged by its per-round time ratio to the last variant (``experiments.bench.paired``): a few
percent of process-to-process drift cancels that alternating whole processes does not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import tyro

from experiments.bench import compile_phases
from experiments.bench import paired as bench_paired
from experiments.bench.comm import (
    expected_compiled_counts, expected_context_parallel_elements, expected_counts, format_report, measure_counts,
    step_collectives,
)
from experiments.bench.config import VARIANTS, BenchConfig
from experiments.bench.workload import compute_dtype, make_step, model_config


def run_worker(bc: BenchConfig) -> dict:
    """Measure one variant in this process."""
    import torch

    torch.set_num_threads(bc.threads)
    device = torch.device(bc.device)
    step = make_step(bc, bc.worker)

    memory = _CudaMemory(device) if device.type == "cuda" else _HostMemory()
    start = time.perf_counter()
    first_loss = float(step())
    first = time.perf_counter() - start
    for _ in range(bc.warmup):
        step()
    resting, peak_so_far = memory.resting_and_peak()
    times = []
    for _ in range(bc.steps):
        start = time.perf_counter()
        loss = step()
        float(loss)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    steps_peak = memory.peak()
    result = {
        "variant": bc.worker, "first_loss": first_loss, "step_s": median, "compile_s": max(first - median, 0.0),
        "peak_mib": max(peak_so_far, steps_peak), "step_memory_mib": steps_peak - resting,
    }
    if bc.worker != "func-eager" and bc.worker != "module-eager":
        cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        result.update(timers=compile_phases.compile_timer_seconds(),
                      kernels=compile_phases.kernel_libraries(cache_dir) if cache_dir else 0)
    return result


class _HostMemory:
    """The process's RSS in MiB (Linux ``/proc``)."""

    def resting_and_peak(self) -> tuple[float, float]:
        """(current RSS, peak RSS so far); then restarts the peak counter."""
        from lmfunc.metrics import memory_stats_mib

        stats = memory_stats_mib()
        _reset_peak_rss()
        return stats["rss"], stats["peak_rss"]

    def peak(self) -> float:
        from lmfunc.metrics import memory_stats_mib

        return memory_stats_mib()["peak_rss"]


class _CudaMemory:
    """Bytes held by live tensors on a CUDA device (the caching allocator's ``allocated``), in MiB."""

    def __init__(self, device):
        self.device = device

    def resting_and_peak(self) -> tuple[float, float]:
        """(allocated now, peak allocated so far); then restarts the peak counter."""
        import torch

        torch.cuda.synchronize(self.device)
        resting = torch.cuda.memory_allocated(self.device) / 2**20
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        torch.cuda.reset_peak_memory_stats(self.device)
        return resting, peak

    def peak(self) -> float:
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) / 2**20


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (VmHWM) of this process (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _compiled_step_counts(cfg, params, local: dict, layout) -> tuple[dict, Optional[dict], dict, Optional[dict]]:
    """Collectives of the compiled train step (AdamW, one microbatch) after a warm-up call, and
    the expected ones; then the elements they send, and the expected ones (cp-only meshes)."""
    from lmfunc.optim import adamw
    from lmfunc.parallel.sharding import local_batch_to_dtensor
    from lmfunc.train import TrainState, make_train_step

    tx = adamw(1e-4)
    step = make_train_step(cfg, tx)
    holder = {"state": TrainState.create(params, tx)}
    batch = local_batch_to_dtensor(local, layout.mesh)

    def call():
        holder["state"], _ = step(holder["state"], batch)

    call()
    import torch.distributed as dist

    gloo = dist.get_backend() == "gloo"
    sizes = layout.sizes
    cp_only = sizes.get("cp", 1) > 1 and math.prod(sizes.values()) == sizes["cp"]
    rows, seq = local["tokens"].shape[-2:]
    expected_elements = (expected_context_parallel_elements(cfg, sizes["cp"], rows, seq, microbatches=1, gloo=gloo)
                         if cp_only else None)
    counts, elements = step_collectives(call)
    return counts, expected_compiled_counts(cfg, sizes, microbatches=1, loss_mask=False, gloo=gloo), elements, expected_elements


def run_comm_report(bc: BenchConfig) -> None:
    """``--comm``: the comm report of the benchmark model on ``bc.comm``'s mesh (rank 0 prints)."""
    import dataclasses as dc

    import torch
    import torch.distributed as dist

    from lmfunc.parallel.mesh import build_mesh, data_parallel_rank
    from lmfunc.parallel.sharding import local_batch_to_dtensor
    from lmfunc.train.params import init_params

    try:
        sizes = {name: int(size) for name, size in (item.split("=") for item in bc.comm.split(","))}
    except ValueError:
        raise SystemExit(f"--comm {bc.comm!r}: write the layout as NAME=SIZE[,NAME=SIZE], e.g. dp_shard=2,tp=2")
    layout = build_mesh(sizes)
    if layout.mesh is None:
        raise SystemExit("--comm needs a layout with more than one process; launch with torchrun --nproc-per-node N")
    cfg = dc.replace(model_config(bc), sequence_parallel=bc.sequence_parallel)
    params = init_params(cfg, layout.mesh)
    dp, rank = layout.data_parallel_size, data_parallel_rank(layout)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, cfg.vocab_size, (bc.batch, bc.seq + 1), generator=g)
    per = bc.batch // dp
    local = {"tokens": stream[None, rank * per:(rank + 1) * per, :-1], "labels": stream[None, rank * per:(rank + 1) * per, 1:]}
    micro = {k: v[0] for k, v in local_batch_to_dtensor(local, layout.mesh).items()}
    measured = measure_counts(params, micro, cfg)
    expected = expected_counts(cfg, layout.sizes)
    if bc.comm_compiled:
        measured["compiled step"], expected_step, measured["compiled step elements"], expected_elements = (
            _compiled_step_counts(cfg, params, local, layout))
        if expected is not None or expected_step is not None:
            expected = {**(expected or {}), "compiled step": expected_step, "compiled step elements": expected_elements}
    if dist.get_rank() == 0:
        print(f"comm report: layout {bc.comm}{' + SP' if bc.sequence_parallel else ''}, layers={bc.layers} "
              f"hidden={bc.hidden} batch={bc.batch} seq={bc.seq}, one microbatch")
        print(format_report(measured, expected))
        if bc.json_out:
            with open(bc.json_out, "w") as f:
                json.dump({"measured": measured, "expected": expected}, f)
    dist.barrier()
    dist.destroy_process_group()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spawn(bc: BenchConfig, variant: str) -> dict:
    """Run one variant (or the paired variants) in a fresh process, with the repository root on
    its path so ``experiments`` imports from any working directory."""
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS=str(bc.threads), PYTHONPATH=path)
    if bc.memory_mode:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        args = [sys.executable, "-m", "experiments.bench", "--worker", variant]
        for field in ("layers", "heads", "hidden", "seq", "vocab", "batch", "steps", "warmup", "threads", "recompute", "dtype", "device"):
            args += [f"--{field}", str(getattr(bc, field))]
        if bc.ce_chunk is not None:
            args += ["--ce-chunk", str(bc.ce_chunk)]
        if not bc.donate:
            args += ["--no-donate"]
        if bc.scan_layers:
            args += ["--scan-layers"]
        if bc.memory_mode:
            args += ["--memory-mode"]
        if not bc.keep_host_memory:
            args += ["--no-keep-host-memory"]
        if variant == "paired":
            args += ["--variants", *bc.variants]
        if bc.warm_cache:
            subprocess.run(args + ["--steps", "1", "--warmup", "0"], env=env, capture_output=True, text=True)
        proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {variant!r} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_device(name: str):
    """``torch.device(name)`` if this process can use it, else exit with what to do."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name!r} is not a device name; use cpu or cuda (or cuda:N)")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name!r}: the benchmark runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name!r}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    return device


def _device_name(device) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()


def main(bc: BenchConfig) -> None:
    import torch

    from lmfunc.metrics import measure_matmul_peak_flops
    from lmfunc.plan.megatron import flops_per_token
    from lmfunc.train.host_memory import keep_freed_host_memory

    if bc.worker is not None:
        if bc.keep_host_memory and not bc.memory_mode:
            keep_freed_host_memory()
        result = bench_paired.run_paired_worker(bc) if bc.worker == "paired" else run_worker(bc)
        print(json.dumps(result))
        return
    if bc.comm is not None:
        run_comm_report(bc)
        return
    unknown = [v for v in bc.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; choose from {list(VARIANTS)}")
    if bc.paired and len(bc.variants) < 2:
        raise SystemExit(f"--paired compares variants with each other; give two or more --variants, got {list(bc.variants)}")

    device = _check_device(bc.device)
    cfg = model_config(bc)
    peak = measure_matmul_peak_flops(device=device, dtype=compute_dtype(bc), n=8192 if device.type == "cuda" else 1024,
                                     threads=bc.threads)
    tokens = bc.batch * bc.seq
    where = f"{device.type} ({_device_name(device)}), torch {torch.__version__}"
    print(f"workload: layers={bc.layers} heads={bc.heads} hidden={bc.hidden} seq={bc.seq} vocab={bc.vocab} "
          f"batch={bc.batch} {bc.dtype}, {tokens} tokens/step, {where}, threads={bc.threads}, recompute={bc.recompute}, "
          f"cross_entropy_chunk_tokens={cfg.cross_entropy_chunk_tokens}, donate_state={bc.donate}, "
          f"scan_layers={bc.scan_layers}"
          + (", memory mode (MALLOC_MMAP_THRESHOLD_=65536)" if bc.memory_mode else
             ", freed host memory kept" if bc.keep_host_memory else ", glibc's malloc defaults")
          + (", warm Inductor cache" if bc.warm_cache else ""))
    print(f"measured {bc.dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s; model {flops_per_token(cfg, bc.seq) / 1e6:.2f} MFLOP/token")
    if bc.paired:
        bench_paired.report(bc, [_spawn(bc, "paired") for _ in range(bc.repeats)], tokens, flops_per_token(cfg, bc.seq) / peak)
        return
    runs: dict[str, list[dict]] = {v: [] for v in bc.variants}
    for r in range(bc.repeats):
        order = bc.variants if r % 2 == 0 else tuple(reversed(bc.variants))
        for variant in order:
            runs[variant].append(_spawn(bc, variant))
            last = runs[variant][-1]
            print(f"  repeat {r + 1} {variant:16s} {last['step_s'] * 1e3:9.1f} ms/step  compile {last['compile_s']:6.1f} s  "
                  f"peak {last['peak_mib']:6.1f} MiB  step mem {last['step_memory_mib']:6.1f} MiB", flush=True)
    memory = "peak CUDA" if device.type == "cuda" else "peak RSS"
    header = (f"{'variant':16s} {'tokens/s':>9s} {'ms/step':>9s} {'MFU':>6s} {memory:>9s} {'step mem':>9s} "
              f"{'compile':>8s} {'loss0':>8s}")
    print(header)
    summary = {}
    for variant, results in runs.items():
        step_s = statistics.median(r["step_s"] for r in results)
        row = {
            "tokens_per_s": tokens / step_s,
            "ms_per_step": step_s * 1e3,
            "mfu": tokens / step_s * flops_per_token(cfg, bc.seq) / peak,
            "peak_mib": statistics.median(r["peak_mib"] for r in results),
            "step_memory_mib": statistics.median(r["step_memory_mib"] for r in results),
            "compile_s": statistics.median(r["compile_s"] for r in results),
            "first_loss": results[0]["first_loss"],
        }
        summary[variant] = row
        print(f"{variant:16s} {row['tokens_per_s']:9.0f} {row['ms_per_step']:9.1f} {row['mfu']:6.1%} "
              f"{row['peak_mib']:8.0f}M {row['step_memory_mib']:8.0f}M {row['compile_s']:7.1f}s {row['first_loss']:8.4f}")
    if bc.phases:
        print("cold compile by phase, seconds (median of the repeats; experiments.bench.compile_phases):")
        print(compile_phases.phase_table(runs))
    if bc.json_out:
        with open(bc.json_out, "w") as f:
            json.dump({"config": dataclasses.asdict(bc), "device": where, "peak_flops": peak, "results": summary,
                       "runs": runs}, f, indent=2)


def cli() -> None:
    """``python -m experiments.bench``: parse the command line and run."""
    main(tyro.cli(BenchConfig, prog="python -m experiments.bench"))


if __name__ == "__main__":
    cli()
