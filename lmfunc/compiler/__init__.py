"""Compiling the train step, and every torch-internal pass or patch that needs, scoped to the
compile: ``compile_step`` is the entry (``compiling``); the recompute pass (``recompute_pass``) and its
choice of saved values (``saved_values``); Inductor's in-place reuse despite input writes
(``inplace_reuse``)."""

from lmfunc.compiler.compiling import call_compiled, compile_graph, compile_step, tracing_settings

__all__ = ["call_compiled", "compile_graph", "compile_step", "tracing_settings"]
