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

Python's imports are not safe on two threads at once (one thread can see a module that the other
is still initialising, and Dynamo's trace imports lazily), so every module the probe imports is
imported before its thread starts, on the calling thread (``PROBE_MODULES``); the probe itself
then imports nothing.
"""

from __future__ import annotations

import importlib
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves


PROBE_MODULES = (
    "torch._inductor.cpu_vec_isa", "torch._inductor.codecache", "torch._inductor.cpp_builder",
    "torch.utils._filelock", "torch.utils.cpp_extension",
)
"""Every module Inductor's probe imports on its way (``torch.utils.cpp_extension`` pulls in
setuptools, which patches distutils as it loads)."""


_start_lock = threading.Lock()
_started: Optional[threading.Thread] = None
"""The probe's thread once one was started in this process (at most one is)."""


def _candidate_isas() -> list:
    """The vector ISAs Inductor will check on this CPU: on x86, those whose flags the CPU reports
    (Inductor's own filter); elsewhere none (Inductor checks at most one there)."""
    from torch._inductor import cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(cpu_vec_isa, "x86_isa_checker"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def _probe() -> None:
    from torch._inductor import cpu_vec_isa

    try:
        candidates = _candidate_isas()
        if len(candidates) > 1:
            with ThreadPoolExecutor(len(candidates), thread_name_prefix="lmfunc-vec-isa-check") as pool:
                list(pool.map(bool, candidates))
        cpu_vec_isa.valid_vec_isa_list()
    except Exception:  # Inductor asks again itself, and reports its own failure there
        pass


def compiles_cpu_code(args: Any) -> bool:
    """Whether a step called with ``args`` (any pytree) computes on the CPU: some tensor argument
    with more than one element lives there (0-dim counters may sit on the CPU beside CUDA data)."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() > 1 for x in tree_leaves(args))


def start_vec_isa_probe(args: Any) -> Optional[threading.Thread]:
    """``start_cpu_vec_isa_probe()`` when ``args`` are CPU tensors (``compiles_cpu_code``), else None."""
    return start_cpu_vec_isa_probe() if compiles_cpu_code(args) else None


def start_cpu_vec_isa_probe() -> Optional[threading.Thread]:
    """Start Inductor's vector-ISA probe on a daemon thread unless this process has probed (or
    is probing) already; return the thread, or None when nothing was started. Callers that know
    early that a CPU compile is coming (the trainer, before it reads its data) start it then."""
    global _started
    for name in PROBE_MODULES:
        importlib.import_module(name)
    from torch._inductor import cpu_vec_isa

    with _start_lock:
        if _started is not None or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
            return None
        _started = threading.Thread(target=_probe, name="lmfunc-vec-isa-probe", daemon=True)
    _started.start()
    return _started
