import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def torchrun():
    """``torchrun(nproc, args, timeout=600)``: a multi-rank run from the repository root that must exit 0."""
    from tests.helpers import run_torchrun

    return run_torchrun


@pytest.fixture
def tiny_state():
    """``tiny_state(tx, loss_scale=None)``: a ``TrainState`` of the ``tiny`` preset initialised with seed 0."""
    from lmfunc import model
    from lmfunc.config import model_preset
    from lmfunc.train import TrainState

    def make(tx, loss_scale=None):
        return TrainState.create(model.init(model_preset("tiny"), seed=0), tx, loss_scale=loss_scale)

    return make


SLOW_DEADLINE = "LMFUNC_SLOW_TESTS_UNTIL"
"""Environment variable: a Unix time after which no further slow test starts (``.ci/run`` sets it so
the slow tests end inside CI's 90-minute budget). Each test not started is reported as skipped with
the reason, in pytest's summary."""


SLOW_ROTATION = "LMFUNC_SLOW_TESTS_ROTATE"
"""Environment variable: a string (``.ci/run`` gives the commit's hash) from which the slow tests'
order is rotated, so a run stopped by the time budget leaves out different tests each commit
instead of always the last ones in file order."""


@pytest.fixture(autouse=True)
def _one_multirank_launch_at_a_time(request):
    """A test marked ``multirank`` holds the machine's multi-rank slot (``tests.helpers.multirank_slot``)
    while it runs; other tests run beside it on the other pytest-xdist worker."""
    if request.node.get_closest_marker("multirank") is None:
        yield
        return
    from tests.helpers import multirank_slot

    with multirank_slot():
        yield


def pytest_itemcollected(item):
    """Tests that use the ``torchrun`` fixture are ``multirank``. Under pytest-xdist's ``--dist
    loadgroup`` every multi-rank test is in one group, so one worker runs them one after another,
    and every other test is grouped with its file, so a file's module-scoped fixtures are built once."""
    if "torchrun" in getattr(item, "fixturenames", ()) and item.get_closest_marker("multirank") is None:
        item.add_marker(pytest.mark.multirank)
    multirank = item.get_closest_marker("multirank") is not None
    item.add_marker(pytest.mark.xdist_group("multirank" if multirank else item.nodeid.split("::")[0]))


@pytest.hookimpl(trylast=True)  # after ``-m slow`` has deselected the rest
def pytest_collection_modifyitems(config, items):
    rotation = os.environ.get(SLOW_ROTATION)
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if not rotation or not slow or len(slow) != len(items):
        return
    import zlib

    offset = zlib.crc32(rotation.encode()) % len(items)
    while offset and items[offset].module is items[offset - 1].module:  # keep each file's tests together
        offset -= 1
    items[:] = items[offset:] + items[:offset]


def pytest_runtest_setup(item):
    deadline = os.environ.get(SLOW_DEADLINE)
    if deadline and item.get_closest_marker("slow") is not None:
        import time

        if time.time() > float(deadline):
            pytest.skip(f"CI time budget spent ({SLOW_DEADLINE}): slow test not started; run `python -m pytest "
                        f"-m slow` to run it")
