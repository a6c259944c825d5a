"""Private torch names for Inductor's buffer and memory planning, which the dry run reads to count
a step's peak the way Inductor schedules it."""

from __future__ import annotations

from lmfunc.compiler.torch_compat import Private, lazy_names

_MEMORY = "the dry run's peak from Inductor's own buffer timeline"
_DRY_RUN = (2, 13)
"""The dry run traces a compiled step on a (fake) DTensor mesh, which needs torch 2.13
(``tracing.TRACES_AUTOGRAD_GRAD``); it refuses an older torch before it reads any of these."""

ENTRIES: dict[str, Private] = {
    "compute_memory_timeline": Private("torch._inductor.memory:compute_memory_timeline", _MEMORY, "none"),
    "peak_memory_from_buf_info_list": Private("torch._inductor.memory:peak_memory_from_buf_info_list", _MEMORY,
                                              "none", since=_DRY_RUN),
    "prepare_planning_info": Private("torch._inductor.memory:prepare_planning_info", _MEMORY, "none"),
    "get_freeable_input_buf": Private("torch._inductor.memory:get_freeable_input_buf", _MEMORY, "none"),
    "MultiOutput": Private("torch._inductor.ir:MultiOutput", "buffers Inductor's timeline counts as 0 bytes",
                           "none"),
    "MultiOutputLayout": Private("torch._inductor.ir:MultiOutputLayout", "the same", "none"),
    "NoneLayout": Private("torch._inductor.ir:NoneLayout", "the same", "none"),
    "NonOwningLayout": Private("torch._inductor.ir:NonOwningLayout", "views of another buffer counted once",
                               "none"),
    "get_dtype_size": Private("torch._inductor.utils:get_dtype_size", "a buffer's bytes", "torch.dtype.itemsize"),
    "GraphLowering": Private("torch._inductor.graph:GraphLowering", "the dry run's hook on each lowered graph",
                             "none"),
    "compile_fx": Private("torch._inductor.compile_fx:compile_fx", "the dry run compiles with Inductor up to "
                          "scheduling", "torch.compile"),
    "compile_fx_inner": Private("torch._inductor.compile_fx:compile_fx_inner", "the same, per graph", "none"),
    "InductorError": Private("torch._inductor.exc:InductorError", "the dry run's own stop signal wrapped by "
                             "Inductor", "none"),
}

__getattr__ = lazy_names(__name__, ENTRIES)
