"""Shared test data, probes and the multi-rank launcher."""

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from typing import Callable, Iterator

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


MOE_SETTINGS = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1),
                    moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
"""The multi-rank workers' MoE (``--moe``): every second layer an MoE layer with sigmoid routing, the
expert bias, a shared expert and two router losses."""
MLA_SETTINGS = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                    qk_pos_emb_head_dim=8, v_head_dim=16)
"""The multi-rank workers' MLA (``--mla``)."""


def model_flags(argv: list[str], num_layers: int = 2) -> dict:
    """The ``ModelConfig`` fields of a worker's ``--moe`` and ``--mla`` flags in ``argv`` for a model of
    ``num_layers`` (even) layers: with ``--moe`` every second one an MoE layer, balanced by the
    sequence-level loss instead of the batch-level one with ``--seq-aux``."""
    moe = {**MOE_SETTINGS, "moe_layer_freq": (0, 1) * (num_layers // 2)} if "--moe" in argv else {}
    if moe and "--seq-aux" in argv:
        moe["moe_router_load_balancing_type"] = "seq_aux_loss"
    return {**moe, **(MLA_SETTINGS if "--mla" in argv else {})}


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node nproc ARGS`` (gloo on CPU); a test that starts it
    itself is marked ``multirank``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def torchrun_env() -> dict:
    """The launcher's environment: one thread per rank, the repository on the path, unbuffered output,
    and Python's stacks printed on a native crash (``PYTHONFAULTHANDLER``)."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")


MULTIRANK_LOCK = os.path.join(tempfile.gettempdir(), "lmfunc-tests-multirank.lock")
"""The file whose exclusive lock a multi-rank launch holds while it runs (``multirank_slot``)."""
_slot_depth = 0


@contextlib.contextmanager
def multirank_slot() -> Iterator[None]:
    """Hold the machine's one multi-rank slot (re-entrant): an exclusive ``flock`` on
    ``MULTIRANK_LOCK``, waited for. Two multi-rank launches at once on a 2-core machine starve each
    other's collectives, so ``run_torchrun`` takes the slot, and so do tests marked ``multirank``
    (``tests/conftest.py``) for their whole run, also when the suite runs on pytest-xdist workers."""
    global _slot_depth
    if _slot_depth:
        _slot_depth += 1
        try:
            yield
        finally:
            _slot_depth -= 1
        return
    with _flock(MULTIRANK_LOCK, fcntl.LOCK_EX):
        _slot_depth = 1
        try:
            yield
        finally:
            _slot_depth = 0


@contextlib.contextmanager
def _flock(path: str, mode: int) -> Iterator[None]:
    """Hold an ``flock`` (``LOCK_EX`` or ``LOCK_SH``) on ``path``, waited for, released on exit."""
    with open(path, "a") as lock:
        fcntl.flock(lock, mode)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_torchrun(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``torchrun_command(nproc, args)`` from the repository root, holding the multi-rank slot;
    fail with its output unless it exits 0."""
    proc = run_torchrun_unchecked(nproc, args, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_torchrun_unchecked(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """``run_torchrun`` without the exit-status check."""
    with multirank_slot():
        return subprocess.run(torchrun_command(nproc, args), cwd=ROOT, env=torchrun_env(), capture_output=True,
                              text=True, timeout=timeout)


def lm_batch(vocab: int, microbatches: int, batch: int, seq: int, seed: int = 0) -> dict:
    """A random token batch ``[M, B, S]`` with labels shifted by one and a partial loss mask."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (microbatches, batch, seq + 1), generator=g)
    mask = (torch.rand(microbatches, batch, seq, generator=g) > 0.2).float()
    return {"tokens": stream[..., :-1], "labels": stream[..., 1:], "loss_mask": mask}


def traced_instructions(call: Callable[[], object]) -> int:
    """How many bytecode instructions Dynamo traces while ``call()`` runs (counted through
    Dynamo's per-instruction ``InstructionTranslatorBase.step``, a private method)."""
    from torch._dynamo import symbolic_convert

    traced = symbolic_convert.InstructionTranslatorBase.step
    count = 0

    def counting_step(self):
        nonlocal count
        count += 1
        return traced(self)

    symbolic_convert.InstructionTranslatorBase.step = counting_step
    try:
        call()
    finally:
        symbolic_convert.InstructionTranslatorBase.step = traced
    return count


_POISONED: list[int] = []


def _poisoned_empty_strided_cpu(size, stride, dtype):
    """Inductor's CPU buffer allocation with floating-point buffers filled with NaN (counted)."""
    buffer = _ALLOCATE[0](size, stride, dtype)
    if dtype.is_floating_point:
        buffer.fill_(float("nan"))
        _POISONED.append(buffer.numel())
    return buffer


_ALLOCATE: list[Callable] = []


@contextlib.contextmanager
def poisoned_memory():
    """Every tensor allocated without initialising it starts as NaN, so code that reads memory it
    never wrote gives NaN on every CPU instead of whatever the allocator happened to return.

    Covers Inductor's buffers (its generated code allocates through
    ``torch._C._dynamo.guards._empty_strided_cpu``, looked up when the code is loaded: compile
    inside this context; buffer reuse is off, so no buffer carries an earlier value) and eager
    ``torch.empty``-style allocations (``torch.utils.deterministic.fill_uninitialized_memory``).
    Yields a list that counts the poisoned Inductor buffers, so a test can check that the poison
    reached the compiled code.
    """
    import torch._C._dynamo.guards as guards
    import torch._inductor.config as inductor_config

    if not _ALLOCATE:
        _ALLOCATE.append(guards._empty_strided_cpu)
    _POISONED.clear()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    guards._empty_strided_cpu = _poisoned_empty_strided_cpu
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with inductor_config.patch(allow_buffer_reuse=False, inplace_buffers=False):
            yield _POISONED
    finally:
        guards._empty_strided_cpu = _ALLOCATE[0]
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def kill_processes_mentioning(text: str) -> int:
    """SIGKILL every process of this user whose command line contains ``text`` (a test's unique
    temporary path): ranks that outlived their launcher. Returns how many were killed."""
    import signal

    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed
