"""The train-step benchmark's settings (``python -m experiments.bench``), shared by its workload,
its paired timing and its report."""

from __future__ import annotations

import dataclasses
from typing import Optional

VARIANTS = ("func-eager", "func-compiled", "func-scan", "module-eager", "module-compiled")
DEFAULT_VARIANTS = ("func-eager", "func-compiled", "module-eager", "module-compiled")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Workload and measurement settings."""

    layers: int = 4
    heads: int = 4
    hidden: int = 256
    seq: int = 256
    vocab: int = 4096
    batch: int = 8
    """Sequences per step (one microbatch)."""
    steps: int = 10
    """Timed steps per run (after warmup)."""
    warmup: int = 2
    """Untimed steps after the first (compiling) step."""
    repeats: int = 3
    """Runs per variant; the variants are alternated and medians reported."""
    threads: int = 1
    """torch intra-op threads (OMP_NUM_THREADS)."""
    recompute: str = "none"
    """model.recompute_granularity of the func variants: none, selective or full."""
    scan_layers: bool = False
    """model.scan_layers of the func variants: the blocks stacked and run by torch's scan (the
    module variants keep one module per block, from the same weights)."""
    ce_chunk: Optional[int] = None
    """model.cross_entropy_chunk_tokens of the func variants (0: all logits at once); default:
    ModelConfig's default."""
    dtype: str = "fp32"
    """Compute dtype: fp32, or bf16 (func variants: ``make_train_step(compute_dtype=bfloat16)``;
    module variants: the forward under ``torch.autocast``, as nanoGPT trains; both keep fp32
    weights and AdamW state). The MFU peak is a matmul measured in the same dtype."""
    device: str = "cpu"
    """Where the model, batch and optimizer state live: cpu, or cuda (fp32 matmuls without TF32,
    torch's default; the MFU peak is measured the same way)."""
    donate: bool = True
    """func variants: ``make_train_step(donate_state=...)`` (the new state written into the old)."""
    memory_mode: bool = False
    """Run the workers with glibc's MALLOC_MMAP_THRESHOLD_=65536, so freed tensors go back to the OS
    and RSS follows live tensor memory (the step-memory column is then exact; times are slower;
    ``keep_host_memory`` is then off)."""
    keep_host_memory: bool = True
    """Workers keep freed host memory for reuse, as ``python -m lmfunc.train`` does by default
    (``run.keep_host_memory``, ``lmfunc.train.host_memory``); off: glibc's defaults, which fault
    blocks of 32 MiB or more in afresh on every step."""
    warm_cache: bool = False
    """Run each worker once, untimed, before the measured run with the same Inductor cache, so
    the measured run loads its compiled graphs instead of compiling them (a restarted job)."""
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    paired: bool = False
    """Speed only: build the variants in one process and run their steps in turn, ``--steps``
    rounds per process (``--repeats`` processes, rounds pooled), and report each variant's
    per-round time ratio to the last variant (``lmfunc.bench_paired``). No memory or compile
    columns: the variants share the process."""
    phases: bool = False
    """Also print where each compiled variant's cold compile goes, phase by phase
    (``experiments.bench.compile_phases``)."""
    json_out: Optional[str] = None
    """Also write the results to this JSON file."""
    comm: Optional[str] = None
    """Instead of timing: count the collectives of one microbatch on this layout ('dp_shard=2',
    'tp=2', 'dp_shard=2,tp=2'; launch with torchrun) next to the expected numbers, eager and in
    the compiled train step."""
    comm_compiled: bool = True
    """With --comm: also compile the train step and count its (bucketed) collectives."""
    sequence_parallel: bool = False
    """With --comm and tp: sequence parallelism."""
    worker: Optional[str] = None
    """Internal: run one variant in this process and print its measurements as JSON."""
