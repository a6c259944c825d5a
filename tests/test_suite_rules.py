"""The rules the test suite itself keeps (docs/testing.md): CI runs the README's test command, a
run that leaves tests unstarted names them (and fails when told to), multi-rank launches take one
slot, and the slowest tests start first."""

import os
import subprocess
import sys

import pytest

from tests.helpers import MULTIRANK_LOCK, ROOT, multirank_slot


def test_ci_runs_the_readmes_test_command():
    with open(os.path.join(ROOT, "README.md")) as f:
        quick_start = f.read().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    test_command = quick_start[1].split("&& ", 1)[1]
    assert test_command.startswith("python -m pytest") and test_command in ci, (test_command, ci)


def test_a_run_that_leaves_tests_unstarted_fails_and_lists_them():
    """With ``LMFUNC_UNSTARTED_FAILS=1`` (without it the run only lists them)."""
    env = dict(os.environ, LMFUNC_SLOW_TESTS_UNTIL="0", LMFUNC_UNSTARTED_FAILS="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider",
                           "tests/test_preprocess.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout[-2000:]
    listed = done.stdout.split("tests the CI time budget left unstarted", 1)[1]
    assert "tests/test_preprocess.py::test_a_100_megabyte_single_line" in listed


@pytest.mark.multirank
def test_a_multirank_test_holds_the_slot_that_other_processes_wait_for():
    """The slot is held for the whole test, re-entered by ``run_torchrun``, and another process
    (another xdist worker) cannot take it meanwhile."""

    def taken_elsewhere() -> bool:
        return not _other_process_gets(MULTIRANK_LOCK, "LOCK_EX")

    assert taken_elsewhere()
    with multirank_slot():
        assert taken_elsewhere()
    assert taken_elsewhere()


def _other_process_gets(lock_file: str, mode: str) -> bool:
    """Whether another process gets the ``flock`` (``LOCK_SH`` or ``LOCK_EX``) on ``lock_file`` at once."""
    script = ("import fcntl, sys\n"
              f"lock = open({lock_file!r}, 'a')\n"
              f"try:\n    fcntl.flock(lock, fcntl.{mode} | fcntl.LOCK_NB)\n"
              "except BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 0


def test_the_files_with_the_slowest_tests_start_first_and_a_file_stays_together():
    """``tests.durations``: the recorded seconds read from pytest's ``--durations`` lines (setup, call
    and teardown summed; xdist's ``@group`` dropped), and the order they give: units of one file in
    one xdist group, slowest first, each unit's tests in their own order, a test no run recorded
    counted as the slowest."""
    import types

    from tests.durations import durations_in_log, longest_first

    log = ("12.50s call     tests/test_a.py::test_long[1 2 1]@multirank\n"
           "2.00s setup    tests/test_a.py::test_long[1 2 1]@multirank\n"
           "3.00s call     tests/test_b.py::test_b1@tests/test_b.py\n"
           "(214 durations < 0.005s hidden.  Use -vv to show these durations.)\n")
    seconds = durations_in_log(log)
    assert seconds == {"tests/test_a.py::test_long[1 2 1]": 14.5, "tests/test_b.py::test_b1": 3.0}

    def item(nodeid, group):
        marker = types.SimpleNamespace(args=(group,))
        return types.SimpleNamespace(nodeid=f"{nodeid}@{group}", get_closest_marker=lambda name: marker)

    items = [item("tests/test_b.py::test_b0", "tests/test_b.py"), item("tests/test_b.py::test_b1", "tests/test_b.py"),
             item("tests/test_a.py::test_short", "multirank"), item("tests/test_a.py::test_long[1 2 1]", "multirank"),
             item("tests/test_b.py::test_b2", "multirank"), item("tests/test_c.py::test_new", "tests/test_c.py")]
    seconds.update({"tests/test_b.py::test_b0": 0.1, "tests/test_a.py::test_short": 1.0, "tests/test_b.py::test_b2": 5.0})
    order = [i.nodeid.split("::")[1] for i in longest_first(items, seconds)]
    assert order == ["test_new@tests/test_c.py", "test_short@multirank", "test_long[1 2 1]@multirank",
                     "test_b2@multirank", "test_b0@tests/test_b.py", "test_b1@tests/test_b.py"]


def test_every_compat_tier_entry_names_a_test_and_ci_runs_the_tier_on_the_oldest_and_newest_torch():
    """``tests/compat_tier.py``: each entry is a test file (and test function) that exists, so a
    renamed test cannot silently leave the tier; ``.ci/run`` runs the tier on the supported range's
    two ends and leaves the tier's slow tests out of the 2.13 slow tier."""
    import ast

    from lmfunc.compiler.torch_compat import SUPPORTED_TORCH
    from tests.compat_tier import COMPAT_TESTS

    for entry in COMPAT_TESTS:
        path, _, test = entry.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            functions = {node.name for node in ast.walk(ast.parse(f.read())) if isinstance(node, ast.FunctionDef)}
        name = test.split("[", 1)[0]
        assert not name or name in functions, f"tests/compat_tier.py: {entry} names no test"
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    for major, minor in SUPPORTED_TORCH:
        assert f'compat_tier {major}.{minor}.0 "compat' in ci
    assert '-m "slow and not compat"' in ci


def test_compat_losses_names_the_step_and_the_run_that_differ():
    from tests.compat_losses import compare

    same = {1: 5.0, 2: 4.0}
    worst, problems = compare({"a": same, "b": {1: 5.0, 2: 4.0 * (1 + 5e-6)}}, steps=2, rtol=1e-5)
    assert problems == [] and 4e-6 < worst < 6e-6
    _, problems = compare({"a": same, "b": {1: 5.0, 2: 4.01}, "c": {1: 5.0}}, steps=2, rtol=1e-5)
    assert len(problems) == 2 and problems[0].startswith("step 2: b 4.01 against a 4.0") and problems[1] == "c has no loss at step 2"
