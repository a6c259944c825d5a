"""Host memory kept in the process for reuse, as CUDA's caching allocator keeps device memory.

glibc's ``malloc`` serves a block at or above its mmap threshold (which grows with the blocks a
process frees, up to 32 MiB) from a fresh ``mmap`` and unmaps it when it is freed. A step that
allocates such a block every time (each stacked ``[L, ...]`` value of ``scan_layers`` is ``L``
layers' worth; any activation of a large enough microbatch) therefore has the kernel fault in and
zero new pages for it on every step, one 4 KiB page at a time. ``keep_freed_host_memory`` turns
mmap off, so every block comes from malloc's heap, and turns trimming off, so freed blocks stay
in the heap for the next step's allocations.

The cost: the process's RSS no longer falls when tensors are freed (a run's RSS stays at its
peak; the peak itself is what the heap needed). ``release_compile_garbage``'s explicit
``malloc_trim`` still hands free heap pages back.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
"""``mallopt`` parameter numbers (glibc's ``malloc.h``)."""

GLIBC_GROWN_DEFAULTS = {M_MMAP_MAX: 65536, M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 64 * 2**20}
"""glibc's settings once its dynamic mmap threshold has grown to its largest value (what a
training process's steps reach after freeing their first large blocks): mmap for blocks of 32 MiB
and more, and the heap's free top handed back above twice that."""

KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}
"""No mmap for any block; the heap's free top is never handed back."""


def keep_freed_host_memory(keep: bool = True) -> bool:
    """Set glibc's malloc to serve every block from its heap and keep freed blocks there
    (``keep``), or back to its grown defaults (``GLIBC_GROWN_DEFAULTS``; for A/B measurements).
    A process-wide setting that applies to later allocations. Returns whether the C library took
    every setting: False without glibc's ``mallopt`` (macOS, Windows), where nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = KEEP if keep else GLIBC_GROWN_DEFAULTS
    taken = [mallopt(param, value) == 1 for param, value in settings.items()]
    return all(taken)
