"""Inductor's CPU kernels built in batches (``lmfunc.compiler.kernel_batches``): which sources are
batched, how they are split, that a batch computes what each kernel computes alone (also two
kernels with helpers of the same name), that a compiled function gives the bits of the unbatched
build, and the fallbacks: a batch GCC refuses, a kernel called before ``wait``."""

import contextlib
from unittest import mock

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.codecache import CppPythonBindingsCodeCache

from lmfunc.compiler import compile_graph, kernel_batches
from lmfunc.compiler.kernel_batches import PendingKernel, batchable, batched_cpu_kernels, split_into_batches

SCALE = """#include <torch/csrc/inductor/cpp_prefix.h>
static inline float helper(float x) { return 2.0f * x; }
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{
    for (int64_t i = 0; i < ks0; ++i) out_ptr0[i] = helper(in_ptr0[i]);
}
"""
SHIFT = """#include <torch/csrc/inductor/cpp_prefix.h>
#pragma GCC diagnostic ignored "-Wunused-function"
static inline float helper(float x) { return x + 1.0f; }
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{
    #pragma omp simd
    for (int64_t i = 0; i < ks0; ++i) out_ptr0[i] = helper(in_ptr0[i]);
}
"""
ARGTYPES = ["const float*", "float*", "const int64_t"]


def test_only_sources_with_one_entry_and_no_macros_are_batched():
    assert batchable(SCALE) and batchable(SHIFT)
    assert not batchable(SCALE.replace("static inline", "#define TWO 2\nstatic inline"))
    assert not batchable(SCALE + SCALE.split("\n", 1)[1])  # two entries
    assert not batchable(SCALE.replace("kernel(", "entry("))


def test_kernels_split_into_balanced_batches_that_keep_their_order():
    kernels = [PendingKernel([], "x" * (10 + 7 * (i % 5)), lambda: None) for i in range(20)]
    batches = split_into_batches(kernels, workers=2)
    assert len(batches) == 2
    assert sorted(id(k) for batch in batches for k in batch) == sorted(id(k) for k in kernels)
    for batch in batches:
        assert [kernels.index(k) for k in batch] == sorted(kernels.index(k) for k in batch)
    sizes = [sum(len(k.source) for k in batch) for batch in batches]
    assert abs(sizes[0] - sizes[1]) <= max(len(k.source) for k in kernels)
    assert split_into_batches(kernels, workers=2) == batches
    assert len(split_into_batches(kernels[:2 * kernel_batches.MIN_KERNELS_PER_BATCH - 1], workers=2)) == 1
    assert len(split_into_batches(kernels, workers=16)) == 20 // kernel_batches.MIN_KERNELS_PER_BATCH
    assert len(split_into_batches(kernels[:3], workers=2)) == 1


def _built(sources: dict[str, str]) -> dict:
    """What a wrapper module's scope holds after registering ``sources`` and waiting."""
    compiler = AsyncCompile()
    scope = {name: compiler.cpp_pybinding(ARGTYPES, source) for name, source in sources.items()}
    compiler.wait(scope)
    return scope


def test_a_batch_computes_what_each_kernel_computes_alone():
    x = torch.arange(6, dtype=torch.float32)
    with batched_cpu_kernels():
        scope = _built({"scale": SCALE, "shift": SHIFT})
    out = torch.empty(6)
    scope["scale"](x, out, 6)
    assert torch.equal(out, 2 * x)
    scope["shift"](x, out, 6)
    assert torch.equal(out, x + 1)
    assert not any(isinstance(value, PendingKernel) for value in scope.values())
    assert {scope["scale"].__name__, scope["shift"].__name__} == {"kernel_0", "kernel_1"}  # one library
    with pytest.raises(RuntimeError, match="takes 3 arguments"):
        scope["scale"](x, out)


def test_a_batch_gcc_refuses_is_built_kernel_by_kernel_with_a_warning():
    x = torch.arange(4, dtype=torch.float32)
    broken = lambda kernels: "this is not C++;\n" + str(len(kernels))  # noqa: E731
    with batched_cpu_kernels(), mock.patch.object(kernel_batches, "batch_source", broken):
        with pytest.warns(RuntimeWarning, match="one by one"):
            scope = _built({"scale": SCALE, "shift": SHIFT})
    out = torch.empty(4)
    scope["shift"](x, out, 4)
    assert torch.equal(out, x + 1)


def test_a_kernel_called_before_wait_is_built_alone():
    x = torch.arange(3, dtype=torch.float32)
    out = torch.empty(3)
    with batched_cpu_kernels():
        compiler = AsyncCompile()
        pending = compiler.cpp_pybinding(ARGTYPES, SCALE)
        assert isinstance(pending, PendingKernel)
        pending(x, out, 3)
    assert torch.equal(out, 2 * x)


def _several_kernels(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 RMSNorm, SwiGLU-like product and softmax: a few fused kernels, reductions included."""
    h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
    g = torch.nn.functional.silu(h @ w) * (h @ w.t())
    return torch.softmax(g.float(), dim=-1), g.sum(0)


def test_a_compiled_function_gives_the_bits_of_the_unbatched_build():
    """The same graph built with and without batching (the second from Inductor's FX graph cache,
    so the same kernel sources, each built alone) gives bit-identical outputs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=generator).to(torch.bfloat16)
    w = torch.randn(32, 32, generator=generator).to(torch.bfloat16)
    with mock.patch.object(kernel_batches, "_build", wraps=kernel_batches._build) as build:
        batched = compile_graph(_several_kernels)(x, w)
        assert build.call_count == 1
        with mock.patch("lmfunc.compiler.compiling.batched_cpu_kernels", contextlib.nullcontext), \
                mock.patch.object(CppPythonBindingsCodeCache, "load_pybinding_async",
                                  wraps=CppPythonBindingsCodeCache.load_pybinding_async) as alone_builds:
            alone = compile_graph(_several_kernels)(x, w)
        assert build.call_count == 1 and alone_builds.call_count >= 2
    for got, want in zip(batched, alone):
        assert torch.equal(got, want)
    eager = _several_kernels(x, w)
    assert torch.allclose(batched[0], eager[0], atol=1e-2)
