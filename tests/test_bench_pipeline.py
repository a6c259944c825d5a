"""The pipeline benchmark (``experiments.bench.pipeline``, torchrun, gloo): its P2P count equals
2 m (S - 1) sends per step, and the microbatches a rank holds at once follow the schedule (GPipe:
all m; 1F1B: at most p on the first rank) and equal ``lmfunc.plan``'s count for each rank."""

import re

import pytest

from tests.helpers import run_torchrun

pytestmark = pytest.mark.multirank


def _run(schedule: str, virtual: int, microbatches: int) -> str:
    return run_torchrun(2, ["-m", "experiments.bench.pipeline", "--schedule", schedule, "--virtual-stages",
                            str(virtual), "--microbatches", str(microbatches), "--steps", "1"]).stdout


@pytest.mark.slow
def test_sends_and_microbatches_in_flight_per_schedule():
    gpipe = _run("gpipe", 1, 4)
    assert re.search(r"sends 8 expected 8", gpipe), gpipe
    assert "most per rank: [4, 4], lmfunc.plan [4, 4]" in gpipe, gpipe
    one_f_one_b = _run("1f1b", 1, 4)
    assert re.search(r"sends 8 expected 8", one_f_one_b), one_f_one_b
    assert "most per rank: [2, 1], lmfunc.plan [2, 1]" in one_f_one_b, one_f_one_b
    interleaved = _run("interleaved-1f1b", 2, 4)
    assert re.search(r"sends 24 expected 24", interleaved), interleaved  # 3 boundaries x 4 microbatches x 2
    assert "most per rank: [5, 3], lmfunc.plan [5, 3]" in interleaved, interleaved
