"""Building a graph's C++ kernels in a few compiler runs instead of one run per kernel.

On the CPU, Inductor writes each fused kernel of a graph as a C++ source of its own and builds it
as a Python extension of its own: one GCC run per kernel (``AsyncCompile.cpp_pybinding``). Each
run first loads Inductor's precompiled header (about 150 MB) and links against libtorch, which
costs about 0.5 s before GCC reaches the kernel's own code (about 0.25 s for a typical kernel), so
a step graph of 60 kernels spends about 45 s of CPU time in GCC, four fifths of it on those
fixed costs. ``batched_cpu_kernels()`` makes the wrapper module Inductor generates for a graph
register its kernels instead, and build them at its ``async_compile.wait``: one extension per
batch (as many batches as Inductor has compile workers, at least ``MIN_KERNELS_PER_BATCH``
kernels each, balanced by source size), each kernel in a namespace of its own under the entry name
``kernel_<i>``, its Python binding beside it. The kernels' code and GCC's command line are
Inductor's own, so each kernel's machine code is what it would have been on its own (GCC builds
each function alone: the kernels call nothing of each other's, and lmfunc's ``-fno-ipa-cp-clone``
keeps GCC from specialising shared helpers per caller).

A batch is keyed and cached like any Inductor C++ library (its source and command line hashed),
so a process that reloads the same compiled graph (Inductor's FX graph cache, a saved step) loads
the built batch without compiling. A kernel whose source this cannot batch safely (not exactly one
``kernel`` entry, or a preprocessor directive other than ``#include`` and ``#pragma``) is built on
its own as Inductor does; so is every kernel of a batch GCC refuses (with a warning), and a kernel
called before ``wait`` (a benchmarking path).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, Callable, Iterator, Optional
from unittest import mock

from lmfunc.compiler.torch_compat.tracing import dynamo_timed
from lmfunc.compiler.torch_compat.inductor import (AsyncCompile, CppPythonBindingsCodeCache, clear_on_fresh_cache, get_compile_threads,
                                               kernel_code_log)

MIN_KERNELS_PER_BATCH = 4
"""The fewest kernels a batch of its own is given. A second batch costs one more fixed cost (about
0.5 s of CPU) and, on an idle core, saves the wall time of compiling its kernels after the first
batch's (about 0.25 s each): worth it from about 4 kernels."""

_KERNEL_ENTRY = re.compile(r'extern "C"\s+void\s+kernel\(')
_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)", re.M)


class PendingKernel:
    """A kernel registered by the wrapper module, built at its ``wait`` (or on its own when called
    first): ``argtypes`` (C++ types of ``kernel``'s arguments) and ``source`` (Inductor's C++)."""

    def __init__(self, argtypes: list[str], source: str, build_alone: Callable[[], Callable]) -> None:
        self.argtypes = list(argtypes)
        self.source = source
        self.build_alone = build_alone
        """Builds this kernel on its own, as Inductor does, and returns its function."""
        self.function: Optional[Callable] = None

    def __call__(self, *args: Any) -> Any:
        if self.function is None:
            self.function = self.build_alone()
        return self.function(*args)


def batchable(source: str) -> bool:
    """Whether ``source`` can share a translation unit: exactly one ``extern "C" void kernel(``
    entry, and no preprocessor directive but ``#include`` and ``#pragma``."""
    directives = {name for name in _DIRECTIVE.findall(source)}
    return len(_KERNEL_ENTRY.findall(source)) == 1 and directives <= {"include", "pragma"}


def _parse_arg_type(argtype: str) -> str:
    return argtype.replace("const ", "")


def batch_source(kernels: list[PendingKernel]) -> str:
    """One C++ source for ``kernels`` (each ``batchable``): their ``#include`` lines first, then
    kernel ``i`` in namespace ``lmfunc_kernel_<i>`` with its entry renamed ``kernel_<i>`` (C
    linkage, so the name is unique in the library), then a Python module ``kernels`` whose function
    ``kernel_<i>`` parses a tuple of arguments (tensors as data pointers, ints, floats) and calls it."""
    includes: list[str] = []
    bodies: list[str] = []
    for i, kernel in enumerate(kernels):
        lines = []
        for line in kernel.source.splitlines():
            if line.lstrip().startswith("#include"):
                if line.strip() not in includes:
                    includes.append(line.strip())
            else:
                lines.append(line)
        body = _KERNEL_ENTRY.sub(f'extern "C" void kernel_{i}(', "\n".join(lines), count=1)
        bodies.append(f"namespace lmfunc_kernel_{i} {{\n{body}\n}}  // namespace lmfunc_kernel_{i}\n")
    bindings = []
    for i, kernel in enumerate(kernels):
        call = ", ".join(f"lmfunc_arg<{_parse_arg_type(t)}>(args, {n})" for n, t in enumerate(kernel.argtypes))
        bindings.append(_BINDING.format(i=i, arg_len=len(kernel.argtypes), call=call))
    methods = "".join(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},\n' for i in range(len(kernels)))
    return "\n".join(includes) + "\n" + "\n".join(bodies) + _MODULE_PREFIX + "".join(bindings) + _MODULE_SUFFIX.format(
        methods=methods)


_MODULE_PREFIX = r"""
// Python module "kernels": kernel_<i>(*args) calls kernel_<i> of the namespaces above.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

// Torch's own function giving a tensor's data pointer; its address comes from the environment.
static void* (*lmfunc_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T lmfunc_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer, an int64_t, a uintptr_t or a float");
    return static_cast<T>(lmfunc_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t lmfunc_arg<int64_t>(PyObject* args, size_t n) {
    auto value = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (value == -1 && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected an int argument");
    return value;
}
template <> inline uintptr_t lmfunc_arg<uintptr_t>(PyObject* args, size_t n) {
    auto value = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (value == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(value);
}
template <> inline float lmfunc_arg<float>(PyObject* args, size_t n) {
    auto value = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (value == -1.0 && PyErr_Occurred()) [[unlikely]] throw std::runtime_error("expected a float argument");
    return static_cast<float>(value);
}
"""

_BINDING = r"""
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args)) [[unlikely]] throw std::runtime_error("a tuple of arguments is required");
        if (PyTuple_GET_SIZE(args) != {arg_len}) [[unlikely]] throw std::runtime_error("kernel_{i} takes {arg_len} arguments");
        lmfunc_kernel_{i}::kernel_{i}({call});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled C++ exception in kernel_{i}");
        return nullptr;
    }}
}}
"""

_MODULE_SUFFIX = r"""
static PyMethodDef lmfunc_methods[] = {{
{methods}    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef lmfunc_module = {{PyModuleDef_HEAD_INIT, "kernels", NULL, -1, lmfunc_methods}};

PyMODINIT_FUNC PyInit_kernels(void) {{
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }}
    char* end = nullptr;
    errno = 0;
    uintptr_t value = std::strtoull(address, &end, 10);
    if (errno != 0 || end == address || value == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not an address");
        return nullptr;
    }}
    lmfunc_tensor_data_ptr = reinterpret_cast<decltype(lmfunc_tensor_data_ptr)>(value);
    PyObject* module = PyModule_Create(&lmfunc_module);
    #ifdef Py_GIL_DISABLED
        if (module != NULL) PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    return module;
}}
"""


@clear_on_fresh_cache
class KernelBatchCodeCache(CppPythonBindingsCodeCache):
    """Inductor's cache of C++ Python extensions (its compile command, precompiled header, on-disk
    cache and file lock) for extensions named ``kernels`` that hold a batch of kernels."""

    cache: dict[str, Callable] = {}
    entry_function = "kernels"

    @staticmethod
    def cache_clear() -> None:
        KernelBatchCodeCache.cache.clear()


def split_into_batches(kernels: list[PendingKernel], workers: int) -> list[list[PendingKernel]]:
    """``kernels`` in at most ``workers`` batches of at least ``MIN_KERNELS_PER_BATCH`` (one batch
    if there are fewer), balanced by source length (each kernel to the shortest batch, longest
    first), each batch in the kernels' order: the same kernels always give the same batches."""
    count = max(1, min(workers, len(kernels) // MIN_KERNELS_PER_BATCH))
    sizes = [0] * count
    owner: dict[int, int] = {}
    for i in sorted(range(len(kernels)), key=lambda i: (-len(kernels[i].source), i)):
        batch = min(range(count), key=lambda b: (sizes[b], b))
        owner[i] = batch
        sizes[batch] += len(kernels[i].source)
    return [[kernels[i] for i in range(len(kernels)) if owner[i] == b] for b in range(count)]


def _submit_fn(async_compile: AsyncCompile) -> Optional[Callable]:
    return async_compile.submit if get_compile_threads() > 1 else None


BUILD_TIMER = "lmfunc.kernel_batches.build"
"""The name of torch's compile timer (``torch._dynamo.utils.compile_times``) for the batches' builds."""


def _build(async_compile: AsyncCompile, kernels: list[PendingKernel]) -> None:
    """Build ``kernels`` in batches and set each one's ``function``; a batch GCC refuses is built
    kernel by kernel (warned)."""
    with dynamo_timed(BUILD_TIMER):
        loads = [(batch, KernelBatchCodeCache.load_async(batch_source(batch), "cpu", submit_fn=_submit_fn(async_compile)))
                 for batch in split_into_batches(kernels, get_compile_threads())]
        for batch, load in loads:
            try:
                module = load()
            except Exception as error:  # GCC's error (CppCompileError) or a load failure
                warnings.warn(f"lmfunc could not build {len(batch)} Inductor CPU kernels as one library "
                              f"({error!s:.300}); building them one by one instead", RuntimeWarning, stacklevel=2)
                for kernel in batch:
                    kernel.function = kernel.build_alone()
                continue
            for i, kernel in enumerate(batch):
                kernel.function = getattr(module, f"kernel_{i}")


@contextlib.contextmanager
def batched_cpu_kernels() -> Iterator[None]:
    """While held, the wrapper modules Inductor loads build their C++ CPU kernels in batches (see
    the module docstring)."""
    original_binding = AsyncCompile.cpp_pybinding
    original_wait = AsyncCompile.wait

    def inductors_build(self: AsyncCompile, kernel: PendingKernel) -> Callable:
        function = original_binding(self, kernel.argtypes, kernel.source)
        return function.result() if hasattr(function, "result") else function

    def cpp_pybinding(self: AsyncCompile, argtypes: list[str], source_code: str):
        if not batchable(source_code):
            return original_binding(self, argtypes, source_code)
        kernel_code_log.info("CPP+Bindings Kernel (lmfunc batch):\n%s", source_code)
        kernel = PendingKernel(argtypes, source_code, lambda: inductors_build(self, kernel))
        self.__dict__.setdefault("_lmfunc_pending_kernels", []).append(kernel)
        return kernel

    def wait(self: AsyncCompile, scope: dict[str, Any]) -> None:
        pending = [k for k in self.__dict__.pop("_lmfunc_pending_kernels", []) if k.function is None]
        if pending:
            _build(self, pending)
        for name, value in list(scope.items()):
            if isinstance(value, PendingKernel):
                scope[name] = value.function if value.function is not None else value
        original_wait(self, scope)

    with mock.patch.object(AsyncCompile, "cpp_pybinding", cpp_pybinding), mock.patch.object(AsyncCompile, "wait", wait):
        yield
