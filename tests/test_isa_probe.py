"""Inductor's CPU vector-ISA probe as lmfunc runs it (``lmfunc.compiler.isa_probe``): beside the
first compile, on threads of its own, and answered from a recorded pass in later processes."""

import json
import os
import subprocess
import sys
import threading

import torch

from lmfunc.compiler import compiling
from lmfunc.compiler.torch_compat.inductor import INDUCTOR_RECORDS_ISA_CHECKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _recording_isa_list(monkeypatch) -> list:
    """Replace Inductor's (process-cached) vector-ISA probe by a cached recorder of the threads
    that ran it."""
    import functools

    from torch._inductor import cpu_vec_isa

    threads = []

    @functools.cache
    def valid_vec_isa_list():
        threads.append(threading.current_thread().name)
        return []

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    return threads


def test_the_first_call_on_cpu_tensors_probes_the_vector_isa_beside_the_trace(monkeypatch):
    """An Inductor step's first call on CPU data starts Inductor's vector-ISA probe on its own
    thread (``lmfunc.compiler.isa_probe``); later calls, steps on other devices and steps that
    Inductor does not compile start none, and a process that probed already probes no more."""
    from lmfunc.compiler import isa_probe

    threads = _recording_isa_list(monkeypatch)
    monkeypatch.setattr(isa_probe, "_started", None)
    assert not isa_probe.compiles_cpu_code({"step": torch.tensor(3), "w": torch.empty(4, 4, device="meta")})
    assert isa_probe.compiles_cpu_code({"step": torch.tensor(3), "w": torch.ones(4, 4)})
    assert isa_probe.start_vec_isa_probe((torch.empty(8, device="meta"),)) is None
    assert compiling.call_compiled(lambda x: 2 * x)(torch.ones(3)).tolist() == [2.0] * 3 and threads == []
    step = compiling.call_compiled(lambda x: 2 * x, probe_cpu_isa=True)
    for _ in range(3):
        assert step(torch.ones(3)).tolist() == [2.0] * 3
    for thread in threading.enumerate():
        if thread.name == "lmfunc-vec-isa-probe":
            thread.join()
    assert threads == ["lmfunc-vec-isa-probe"]
    assert isa_probe.start_vec_isa_probe((torch.ones(3),)) is None
    monkeypatch.setattr(isa_probe, "_started", None)
    assert isa_probe.start_cpu_vec_isa_probe() is None  # the list is cached: nothing left to probe



PROBE_IMPORTS = """
import json, sys, torch
from lmfunc.compiler import isa_probe
seen = {}
probe = isa_probe._probe

def recording_probe():
    before = set(sys.modules)
    probe()
    seen["imported"] = sorted(set(sys.modules) - before)
    from torch._inductor import cpu_vec_isa
    seen["isas"] = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]

isa_probe._probe = recording_probe
isa_probe.start_vec_isa_probe((torch.ones(4),)).join()
print(json.dumps(seen))
"""


def test_the_isa_probe_thread_imports_nothing_and_finds_what_inductor_finds():
    """In a fresh interpreter the probe's thread imports no module (imports on two threads at once
    can fail: ``lmfunc.compiler.isa_probe``), and it leaves Inductor's cached list of this CPU's
    vector ISAs as Inductor computes it alone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", PROBE_IMPORTS], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["imported"] == []
    alone = subprocess.run([sys.executable, "-c", "from torch._inductor import cpu_vec_isa; "
                            "print([str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()])"],
                           env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert str(seen["isas"]) == alone.stdout.strip().splitlines()[-1]


RECORDED_PROBE = """
import json, os, torch
from torch._inductor import cpu_vec_isa
from lmfunc.compiler import isa_probe
loads = []
real_load = cpu_vec_isa.VecISA._probe_load

def counted_load(self, path):
    loads.append(str(self))
    return False if str(self) == os.environ.get("FAIL_ISA") else real_load(self, path)

cpu_vec_isa.VecISA._probe_load = counted_load
isa_probe.start_vec_isa_probe((torch.ones(4),)).join()
candidates = isa_probe._candidate_isas()
print(json.dumps({"isas": [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()], "loads": sorted(loads),
                  "candidates": [str(isa) for isa in candidates], "record": isa_probe.record_path(candidates)}))
"""


def _probe_in_a_process(cache_dir, fail_isa: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "FAIL_ISA": fail_isa}
    done = subprocess.run([sys.executable, "-c", RECORDED_PROBE], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _recorded(path: str) -> list:
    """The checks recorded at ``path`` (none when no check has passed yet, as on a CPU with one
    candidate ISA that failed)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["passed"]


def test_a_later_process_takes_the_recorded_passes_without_loading_a_probe_library(tmp_path):
    """The first process checks every candidate ISA (builds and loads its probe programs) and
    records the checks that passed in Inductor's cache; a later process on the same machine gets
    the same list without loading anything. A check missing from the record runs again, and a
    check that failed is not recorded."""
    first = _probe_in_a_process(tmp_path / "cache")
    if not first["candidates"]:  # not x86: Inductor checks at most one ISA there, and nothing is recorded
        assert not os.path.exists(first["record"])
        return
    assert set(first["loads"]) == set(first["candidates"]) and first["isas"] == first["candidates"]
    passes = _recorded(first["record"])
    if INDUCTOR_RECORDS_ISA_CHECKS:  # torch records each library that loaded: lmfunc keeps no record of its own
        later = _probe_in_a_process(tmp_path / "cache")
        assert passes == [] and later["loads"] == [] and later["isas"] == first["isas"]
        return
    assert len(passes) == len(first["loads"])
    later = _probe_in_a_process(tmp_path / "cache")
    assert later["loads"] == [] and later["isas"] == first["isas"] and later["record"] == first["record"]

    with open(first["record"], "w") as f:
        json.dump({"passed": passes[1:]}, f)
    assert len(_probe_in_a_process(tmp_path / "cache")["loads"]) == 1
    assert len(_recorded(first["record"])) == len(passes)

    os.remove(first["record"])
    weakest = first["candidates"][-1]
    failed = _probe_in_a_process(tmp_path / "cache", fail_isa=weakest)
    assert failed["isas"] == first["candidates"][:-1]
    assert len(_recorded(failed["record"])) == len(passes) - first["loads"].count(weakest)
    again = _probe_in_a_process(tmp_path / "cache")
    assert again["loads"] == [weakest] and again["isas"] == first["candidates"]
