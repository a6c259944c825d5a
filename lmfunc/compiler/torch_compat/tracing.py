"""Private torch names for Dynamo, AOTAutograd and fake tensors, with the version branches of the
compiled step's tracing."""

from __future__ import annotations

import contextlib
from typing import Any

from lmfunc.compiler.torch_compat import Private, lazy_names, torch_at_least

ENTRIES: dict[str, Private] = {
    "dynamo_config": Private("torch._dynamo.config", "trace_autograd_ops (torch.autograd.grad traced into the "
                             "step's one graph) and capture_scalar_outputs, held while a step is traced",
                             "torch.compiler.config has neither"),
    "Unsupported": Private("torch._dynamo.exc:Unsupported", "a recompile started without the tracing settings is "
                           "retried with them", "none"),
    "dynamo_timed": Private("torch._dynamo.utils:dynamo_timed", "the batched kernel builds counted in torch's "
                            "compile timers", "none"),
    "functorch_config": Private("torch._functorch.config", "AOTAutograd's recompute, donated buffers and cache "
                                "settings while the step compiles", "none"),
    "partitioners": Private("torch._functorch.partitioners", "the saved RNG states' order in the min-cut "
                            "partition", "none"),
    "must_recompute": Private("torch._functorch.partitioners:must_recompute", "the recompute pass reads "
                              "AOTAutograd's recompute tags", "none"),
    "cleanup_recompute_tags": Private("torch._functorch.partitioners:cleanup_recompute_tags", "the recompute pass "
                                      "clears tags the way AOTAutograd does", "none"),
    "FakeScriptObject": Private("torch._library.fake_class_registry:FakeScriptObject", "an opaque object "
                                "(a DeviceMesh) among the saved values (is_opaque_node)", "none"),
    "TracingContext": Private("torch._guards:TracingContext", "Inductor compiles the captured graph after "
                              "Dynamo's context is gone, in a fresh one", "none"),
    "tracing": Private("torch._guards:tracing", "enters that fresh tracing context", "none"),
    "FakeTensorMode": Private("torch._subclasses.fake_tensor:FakeTensorMode", "fake inputs of a compile and of "
                              "the dry run", "torch.export's fake mode is not public; none"),
    "AOTCompilePickler": Private("torch._dynamo.aot_compile:AOTCompilePickler", "the precompiled step pickles "
                                 "what its graph closes over", "torch.compiler.save_cache_artifacts covers "
                                 "Inductor only"),
}

__getattr__ = lazy_names(__name__, ENTRIES)

TRACES_AUTOGRAD_GRAD = torch_at_least(2, 13)
"""Whether Dynamo traces ``torch.autograd.grad`` on fresh leaves into one graph
(``dynamo_config.trace_autograd_ops``, 2.13+). Older torch differentiates a compiled step with
``torch.func`` instead (``lmfunc.grad``), which sees no DTensor and no custom op's autograd."""


def optimization_hint(size: Any, fallback: int) -> int:
    """A size's hint, or ``fallback`` for an unbacked one: torch's ``optimization_hint`` (2.13+),
    ``hint_int`` before it (the same answer)."""
    from torch.fx.experimental import symbolic_shapes

    if hasattr(symbolic_shapes, "optimization_hint"):
        return symbolic_shapes.optimization_hint(size, fallback=fallback)
    return symbolic_shapes.hint_int(size, fallback=fallback)


def is_opaque_node(node: Any) -> bool:
    """Whether an FX node's value is an opaque object (a DeviceMesh or process group the step's
    graph holds) rather than a tensor or size: AOTAutograd's own test (2.13+), or the fake script
    object that 2.11 and 2.12 save as such."""
    from torch._functorch._aot_autograd import graph_compile

    if hasattr(graph_compile, "is_opaque_node"):
        return graph_compile.is_opaque_node(node)
    return isinstance(getattr(node, "meta", {}).get("val"), __getattr__("FakeScriptObject"))


def scan_settings() -> contextlib.AbstractContextManager:
    """Held around a call of ``scan`` (``tensors.scan``). Eagerly, torch runs ``scan`` through Dynamo,
    which lifts the body's Python floats (the config's dropout rates and softmax scale) into
    symbolic float inputs; torch 2.15's ``scan`` takes only tensors and integers there, so they
    stay constants (``specialize_float``), as they are when the whole step is traced. Inside a
    trace the step's own settings hold, and nothing changes."""
    import torch

    if torch.compiler.is_compiling() or not torch_at_least(2, 15):
        return contextlib.nullcontext()
    return __getattr__("dynamo_config").patch(specialize_float=True)
