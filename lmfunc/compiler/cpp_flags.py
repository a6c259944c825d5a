"""The C++ compiler flags Inductor's CPU kernels need while lmfunc compiles: ``-fno-ipa-cp-clone`` for GCC.

Why: ATen's AVX-512 transpose of a 32 x 32 tile of 16-bit values (``at::vec::transpose_mxn`` for
``BFloat16`` and ``Half``, which Inductor's CPU kernels call to read a bf16/fp16 tensor in
transposed order) comes out wrong when GCC 12.2 compiles it at ``-O3``, Inductor's level: in the
clone GCC makes for the constant tile size (``-fipa-cp-clone``), the SLP vectoriser's code leaves
all but the first four elements of each transposed row garbage (other bytes of the stack). With ``-O2``, ``-fno-ipa-cp-clone`` or ``-fno-tree-slp-vectorize`` it is correct.
Only AVX-512 machines run that code (AVX2 uses a 16 x 16 transpose that compiles correctly), so
there a compiled bf16 or fp16 step whose graph transposes a 16-bit tensor returned NaN
gradients, and the eager step did not. ``tests/test_cpp_flags.py`` checks the transpose on any
machine and the flag in Inductor's compile command.

The flag enters Inductor's command line, which keys its compiled kernels and precompiled headers,
so kernels compiled without it are not reused while it holds; it holds only while lmfunc compiles
or loads a step (``lmfunc.compiler.compiling``), never process-wide.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from lmfunc.compiler.torch_compat.inductor import cpp_builder

GCC_FLAGS = ("fno-ipa-cp-clone",)
"""Added to Inductor's optimisation flags when its C++ compiler is GCC (without the leading dash,
as Inductor writes them)."""


@contextlib.contextmanager
def gcc_flags_for_correct_kernels() -> Iterator[None]:
    """While held, Inductor's C++ compiles with GCC also get ``GCC_FLAGS`` (see the module docstring)."""
    original = cpp_builder._get_optimization_cflags

    def optimization_cflags(cpp_compiler: str, *args, **kwargs):
        cflags, ldflags = original(cpp_compiler, *args, **kwargs)
        if cpp_builder._is_gcc(cpp_compiler):
            cflags = [*cflags, *(flag for flag in GCC_FLAGS if flag not in cflags)]
        return cflags, ldflags

    cpp_builder._get_optimization_cflags = optimization_cflags
    try:
        yield
    finally:
        cpp_builder._get_optimization_cflags = original
