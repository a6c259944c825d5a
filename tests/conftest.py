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


@pytest.fixture(autouse=True)
def _multirank_slot(request):
    """A test marked ``multirank`` holds the machine's one multi-rank slot
    (``tests.helpers.multirank_slot``) while it runs: under pytest-xdist, the other worker runs
    single-process tests beside a multi-rank one, never a second one."""
    import contextlib

    from tests.helpers import multirank_slot

    multirank = request.node.get_closest_marker("multirank") is not None
    with multirank_slot() if multirank else contextlib.nullcontext():
        yield


def pytest_itemcollected(item):
    """Tests that use the ``torchrun`` fixture are ``multirank``; those ``tests/compat_tier.py`` lists
    are ``compat``. Under pytest-xdist's ``--dist
    loadgroup`` every multi-rank test is in one group, so one worker runs them one after another,
    and every other test is grouped with its file, so a file's module-scoped fixtures are built once."""
    if "torchrun" in getattr(item, "fixturenames", ()) and item.get_closest_marker("multirank") is None:
        item.add_marker(pytest.mark.multirank)
    from tests.compat_tier import in_compat_tier

    if in_compat_tier(item.nodeid):
        item.add_marker(pytest.mark.compat)
    multirank = item.get_closest_marker("multirank") is not None
    item.add_marker(pytest.mark.xdist_group("multirank" if multirank else item.nodeid.split("::")[0]))


def pytest_configure(config):
    """pytest-xdist hands out its groups in the suite's order (``pytest_collection_modifyitems``), not
    largest group first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected tests
def pytest_collection_modifyitems(config, items):
    """The files with the slowest tests first (``tests.durations``: seconds of a recorded CI run)."""
    from tests.durations import longest_first, read_durations

    items[:] = longest_first(items, read_durations())


NOT_STARTED = f"CI time budget spent ({SLOW_DEADLINE}): slow test not started"
_not_started: list[str] = []


def pytest_runtest_setup(item):
    deadline = os.environ.get(SLOW_DEADLINE)
    if deadline and item.get_closest_marker("slow") is not None:
        import time

        if time.time() > float(deadline):
            pytest.skip(f"{NOT_STARTED}; run `python -m pytest -m slow` to run it")


def pytest_runtest_logreport(report):
    """Remember each test the deadline left unstarted (on the controller, from every xdist worker)."""
    if report.skipped and NOT_STARTED in str(report.longrepr):
        _not_started.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _not_started:
        terminalreporter.section("tests the CI time budget left unstarted", red=True)
        for nodeid in _not_started:
            terminalreporter.write_line(nodeid)


UNSTARTED_FAILS = "LMFUNC_UNSTARTED_FAILS"
"""Environment variable: with ``1`` a run that left tests unstarted fails (after listing them), so
the budget can never silently shrink what is checked. ``.ci/run`` sets it for the slow tier
(docs/testing.md)."""


def pytest_sessionfinish(session):
    if _not_started and os.environ.get(UNSTARTED_FAILS) == "1" and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
