"""``lmfunc.train.host_memory``: freed host blocks kept in the process for the next step's use."""

import os
import platform
import subprocess
import sys

import pytest

from lmfunc.train.host_memory import keep_freed_host_memory

BLOCK_MIB = 40

FAULTS_PER_BLOCK = f"""
import resource, sys, torch
from lmfunc.train.host_memory import keep_freed_host_memory
assert keep_freed_host_memory(sys.argv[1] == "keep"), "mallopt refused a setting"
elements = {BLOCK_MIB} * 2**20 // 4
for _ in range(8):
    torch.empty(elements).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.empty(elements).fill_(1.0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
"""


def _faults_per_block(mode: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_BLOCK, mode], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="needs Linux with glibc (mallopt, page-fault counts)")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    """A 40 MiB block allocated, filled and freed over and over (a step's large activation): with
    glibc's defaults every allocation is a fresh mmap whose pages fault in again (10,240 faults of
    4 KiB, or at least 20 with transparent huge pages); kept, the heap hands back the same pages."""
    kept, released = _faults_per_block("keep"), _faults_per_block("release")
    assert kept < BLOCK_MIB * 256 / 100, f"{kept} page faults per kept block"
    assert released >= BLOCK_MIB / 2, f"only {released} page faults per released block"


def test_without_mallopt_nothing_is_set(monkeypatch):
    """Off glibc (no ``mallopt`` in the C library) the call changes nothing and says so."""

    class NoMallopt:
        def __init__(self, name):
            pass

    monkeypatch.setattr("ctypes.CDLL", NoMallopt)
    assert keep_freed_host_memory() is False
