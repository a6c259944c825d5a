"""Per-phase timers: the phases each level reports, and the slowest rank named across ranks."""

import os
import time

import pytest

from lmfunc.train.log import read_log
from lmfunc.train.timers import LEVEL_PHASES, PhaseTimers, format_timers


def test_levels_and_single_process_report():
    timers = PhaseTimers(1)
    with timers.phase("data"):
        time.sleep(0.02)
    timers.add("step", 0.5)
    report = timers.report()
    assert set(report) == {f"{p}_{k}" for p in LEVEL_PHASES[1] for k in ("max", "min", "slowest_rank")}
    assert report["data_max"] >= 0.02 and report["step_max"] == 0.5 and report["eval_max"] == 0.0
    assert timers.report()["step_max"] == 0.0  # reset after each report
    assert PhaseTimers(0).report() == {}
    assert "step_host" in PhaseTimers(2).phases
    assert format_timers(report, 1).startswith("timers (s per log interval, max over ranks): data 0.0")
    with pytest.raises(ValueError, match="unknown timer phase 'dta'"):
        timers.add("dta", 1.0)


def test_the_report_names_the_straggler(tmp_path, torchrun):
    """Rank 1 loads each batch 1.2 s late: its data phase is the max, and the report names it.
    The loader builds up to 3 batches ahead while the run sets up (``PrefetchLoader``), so the
    first interval's steps may find their batches ready, however slowly they were made; the
    second interval's (steps 5-8) wait for each one on rank 1, whatever the setup took."""
    torchrun(2, ["tests/straggler_worker.py", str(tmp_path)])
    records = [r for r in read_log(os.path.join(tmp_path, "straggler", "log.jsonl")) if r["kind"] == "timers"]
    assert [r["step"] for r in records] == [4, 8]
    last = records[-1]
    assert last["data_slowest_rank"] == 1
    assert last["data_max"] > 1.0 and last["data_min"] < last["data_max"] / 2
