"""Compiling the train step, and every torch-internal pass or patch that needs, scoped to the
compile: ``compile_step`` is the entry (``compiling``); the recompute pass (``recompute_pass``) and its
choice of saved values (``saved_values``); Inductor's in-place reuse despite input writes
(``inplace_reuse``); the CPU kernels built in batches (``kernel_batches``); Inductor's check of the
CPU's vector ISAs, beside the compile and recorded for later processes (``isa_probe``); the whole
compiled step saved to disk for restarts (``precompiled``)."""

from lmfunc.compiler.compiling import call_compiled, compile_graph, compile_step, tracing_settings
from lmfunc.compiler.precompiled import precompiled_step

__all__ = ["call_compiled", "compile_graph", "compile_step", "precompiled_step", "tracing_settings"]
