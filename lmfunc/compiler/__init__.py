"""Compiling the train step, and every torch-internal pass or patch that needs, scoped to the
compile: ``compile_step`` is the entry (``compiling``); the recompute pass (``recompute_pass``) and its
choice of saved values (``saved_values``); Inductor's in-place reuse despite input writes
(``inplace_reuse``); the CPU kernels built in batches (``kernel_batches``); Inductor's check of the
CPU's vector ISAs, beside the compile and recorded for later processes (``isa_probe``); the whole
compiled step saved to disk for restarts (``precompiled``). ``torch_compat`` holds every private
torch name lmfunc uses, with its version branches.

The names below load on first use: every layer imports ``torch_compat`` from here, and importing
it must not import the compiler itself."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"call_compiled": "compiling", "compile_graph": "compiling", "compile_step": "compiling",
            "tracing_settings": "compiling", "precompiled_step": "precompiled"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmfunc.compiler' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lmfunc.compiler.{_EXPORTS[name]}"), name)
