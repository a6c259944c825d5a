"""``tests.worker_cases``: several cases per launch, and each test still sees only its own case's
result; a case that fails fails its test and every case the launch left unfinished."""

import types

import pytest

from tests.worker_cases import Case, run_batched, split_cases


def test_cases_are_the_arguments_between_case_flags():
    assert split_cases(["a", "1"]) == [["a", "1"]]
    assert split_cases(["--case", "a", "1", "--case", "--case", "b"]) == [["a", "1"], [], ["b"]]
    with pytest.raises(SystemExit, match="arguments before the first --case"):
        split_cases(["a", "--case", "b"])


@pytest.mark.multirank
def test_one_launch_runs_the_module_s_cases_and_each_test_sees_its_own(tmp_path_factory):
    """Four tests of one module (simulated items) share a 2-rank launch of the probe worker; the
    first asks, the launch runs all four in their order: the first passes with its own lines, the
    failing one fails with its error, the two after it fail as not finished, and no second
    launch happens."""
    module = types.ModuleType("probe_tests")
    items = [types.SimpleNamespace(module=module, name=name) for name in ("first", "fail", "after", "last")]
    cases = {item.name: Case("tests.worker_cases_probe", 2, (item.name, "x")) for item in items}
    request = types.SimpleNamespace(node=items[0], session=types.SimpleNamespace(items=items),
                                    getfixturevalue={"tmp_path_factory": tmp_path_factory}.__getitem__)

    def case_of(item):
        return cases[item.name]

    result = run_batched(request, case_of)
    assert sorted(result.lines) == ["rank 0 ok: first x", "rank 1 ok: first x"]
    request.node = items[1]
    with pytest.raises(pytest.fail.Exception, match=r"rank \d FAILED: AssertionError: rank \d: failed as asked"):
        run_batched(request, case_of)
    for later in items[2:]:
        request.node = later
        with pytest.raises(pytest.fail.Exception, match="not finished: the launch exited 1"):
            run_batched(request, case_of)
