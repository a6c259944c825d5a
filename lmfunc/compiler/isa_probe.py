"""Inductor's CPU vector-ISA probe, started in the background when a compile of CPU code begins.

Before Inductor writes its first C++ kernel it asks which vector instruction sets the CPU runs
(``torch._inductor.cpu_vec_isa.valid_vec_isa_list``, cached per process). To answer, it builds a
small program with GCC for each candidate ISA (AMX, AVX-512 VNNI, AVX-512, AVX2 on a recent Intel
CPU) and loads each in a child process, one after the other: seconds per candidate with a fresh
Inductor cache (less with a warm one), all of it spent waiting on GCC and the children
(docs/performance.md, "Where a cold compile goes").
Inductor asks only after Dynamo's trace, AOTAutograd and its own lowering, which are Python on one
core. Started when the compile starts, the probe checks the candidate ISAs side by side on other
threads meanwhile (each check is cached on its ISA object), and Inductor's question then finds its
answer cached.

The answer is the one Inductor would compute itself, so the compiled code is the same. If the
probe has not finished when Inductor asks, Inductor computes it again, waiting on the probe's
locked builds: no slower than without the probe.

Every process that compiles asks again, and even with the probe programs built (a warm cache) each
check loads its library in a child process (about 0.3 s of CPU per check, beside the compile on a
2-core machine). So the probe records each check that passed (the ISA, its compiler flags and the
program: Inductor checks AVX-512's bf16 and VNNI instructions with programs of their own) in
Inductor's cache directory, ``lmfunc_vec_isa/<key>.json``, keyed by everything a pass rests on:
the CPU's model and flags as the kernel reports them, the C++ compiler's version, torch's build and
the Python executable. A later process with the same key answers those checks True without
building or loading anything; any other check runs as Inductor's. A failed check is never
recorded (it may have been a timeout on a loaded machine), so it runs again in the next process.
From torch 2.15 on, Inductor records each library that loaded itself (a ``.load_ok`` file beside
it), so a later process loads nothing either way; there the probe keeps no record of its own
(``torch_compat.inductor.INDUCTOR_RECORDS_ISA_CHECKS``) and only runs the checks beside the trace.

Python's imports are not safe on two threads at once (one thread can see a module that the other
is still initialising, and Dynamo's trace imports lazily), so every module the probe imports is
imported before its thread starts, on the calling thread (``torch_compat.inductor.ISA_PROBE_MODULES``); the probe itself
then imports nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from lmfunc.compiler.torch_compat.inductor import (INDUCTOR_RECORDS_ISA_CHECKS, ISA_PROBE_MODULES, cache_dir, cpp_builder,
                                                   cpu_vec_isa)
from lmfunc.compiler.torch_compat.tensors import pytree


_start_lock = threading.Lock()
_started: Optional[threading.Thread] = None
"""The probe's thread once one was started in this process (at most one is)."""


def _candidate_isas() -> list:
    """The vector ISAs Inductor will check on this CPU: on x86, those whose flags the CPU reports
    (Inductor's own filter); elsewhere none (Inductor checks at most one there)."""
    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(cpu_vec_isa, "x86_isa_checker"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def _cpu_description() -> str:
    """The CPU's model and the flags the kernel reports for it (Linux's ``/proc/cpuinfo``, first
    processor), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return f"{platform.processor()} {platform.machine()}"
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in ("model name", "flags"))


def record_path(candidates: list) -> str:
    """Where the answer for ``candidates`` on this CPU, compiler, torch build and Python is recorded
    (in Inductor's cache directory)."""

    facts = [_cpu_description(), cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler()), torch.__version__,
             str(torch.version.git_version), sys.executable, *map(str, candidates)]
    key = hashlib.sha256("\0".join(facts).encode()).hexdigest()[:32]
    return os.path.join(cache_dir(), "lmfunc_vec_isa", f"{key}.json")


def _recorded_passes(path: str) -> set[str]:
    try:
        with open(path) as f:
            return set(json.load(f)["passed"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _replaying_checks(isa, recorded: set[str], passed: set[str]) -> Callable[[str], bool]:
    """``isa``'s build-and-load check of a program, answered True at once when the same check
    (ISA, compiler flags, program) is in ``recorded``; else run, and added to ``passed`` if it passes."""
    real_check = type(isa).check_build

    def check_build(code: str) -> bool:
        key = hashlib.sha256(f"{type(isa).__name__}\0{isa.build_arch_flags()}\0{code}".encode()).hexdigest()
        if key in recorded:
            return True
        ok = real_check(isa, code)
        if ok:
            passed.add(key)
        return ok

    return check_build


def _record_passes(path: str, passes: set[str]) -> None:
    partial = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(partial, "w") as f:
        json.dump({"passed": sorted(passes)}, f)
    os.replace(partial, path)


def _probe() -> None:
    try:
        candidates = _candidate_isas()
        path = record_path(candidates) if candidates and not INDUCTOR_RECORDS_ISA_CHECKS else None
        recorded = _recorded_passes(path) if path is not None else set()
        passed: set[str] = set()
        for isa in candidates:
            isa.check_build = _replaying_checks(isa, recorded, passed)
        try:
            with ThreadPoolExecutor(max(len(candidates), 1), thread_name_prefix="lmfunc-vec-isa-check") as pool:
                list(pool.map(bool, candidates))
        finally:
            for isa in candidates:
                del isa.check_build
        if path is not None and passed - recorded:
            _record_passes(path, recorded | passed)
        cpu_vec_isa.valid_vec_isa_list()
    except Exception:  # Inductor asks again itself, and reports its own failure there
        pass


def compiles_cpu_code(args: Any) -> bool:
    """Whether a step called with ``args`` (any pytree) computes on the CPU: some tensor argument
    with more than one element lives there (0-dim counters may sit on the CPU beside CUDA data)."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() > 1 for x in pytree.tree_leaves(args))


def start_vec_isa_probe(args: Any) -> Optional[threading.Thread]:
    """``start_cpu_vec_isa_probe()`` when ``args`` are CPU tensors (``compiles_cpu_code``), else None."""
    return start_cpu_vec_isa_probe() if compiles_cpu_code(args) else None


def start_cpu_vec_isa_probe() -> Optional[threading.Thread]:
    """Start Inductor's vector-ISA probe on a daemon thread unless this process has probed (or
    is probing) already; return the thread, or None when nothing was started. Callers that know
    early that a CPU compile is coming (the trainer, before it reads its data) start it then."""
    global _started
    for name in ISA_PROBE_MODULES:
        importlib.import_module(name)
    with _start_lock:
        if _started is not None or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return None
        _started = threading.Thread(target=_probe, name="lmfunc-vec-isa-probe", daemon=True)
    _started.start()
    return _started
