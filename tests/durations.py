"""The seconds each test took in a recorded CI run (``tests/durations.json``), and the suite's order
from them: the files with the slowest tests first.

Under pytest-xdist (``--dist loadgroup``) each worker takes the next group of tests when it has
run out; a long test taken last keeps one worker busy while the other waits. Started longest
first, the tests a worker takes last are short ones, so both workers end close together, and the
slow tier's start limit (``.ci/run``) is met by tests that end soon after it.

``python -m tests.durations LOG [LOG ...]`` records the seconds (setup, call and teardown summed)
that pytest's ``--durations=0`` printed in the LOGs (``.ci/run`` outputs, say) into the file, a
test's mean over the LOGs that name it (a test's seconds depend on what ran beside it);
a test that no log names keeps its recorded seconds, or 0 s if it has none (pytest leaves out
durations under 5 ms); a test the suite no longer has is dropped."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

DURATIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
_LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def read_durations(path: str = DURATIONS_FILE) -> dict[str, float]:
    """Test node id (without pytest-xdist's ``@group``) -> seconds; empty when the file is absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def plain_nodeid(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` that pytest-xdist's ``--dist loadgroup`` appends."""
    return nodeid.rsplit("@", 1)[0] if "@" in nodeid.split("::")[-1] else nodeid


def durations_in_log(text: str) -> dict[str, float]:
    """The seconds per test in pytest's ``--durations`` lines of ``text``: ``12.34s call tests/x.py::t``,
    the setup, call and teardown of one test summed."""
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            nodeid = plain_nodeid(match.group(3))
            seconds[nodeid] = seconds.get(nodeid, 0.0) + float(match.group(1))
    return seconds


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` (pytest items) reordered so that each run of one file's tests in one pytest-xdist
    group (a unit a worker takes whole, whose module-scoped fixtures are built once) stays together
    in its order, and the units come slowest first: a unit counts as its slowest test, a test no
    recorded run names as the slowest of all (a new test is not left to the end)."""
    def unit(item) -> tuple[str, str]:
        group = item.get_closest_marker("xdist_group")
        return item.nodeid.split("::")[0], group.args[0] if group else ""

    slowest: dict[tuple[str, str], float] = {}
    for item in items:
        key = unit(item)
        slowest[key] = max(slowest.get(key, 0.0), seconds.get(plain_nodeid(item.nodeid), math.inf))
    rank = {key: i for i, key in enumerate(sorted(slowest, key=lambda key: -slowest[key]))}
    order = {id(item): i for i, item in enumerate(items)}
    return sorted(items, key=lambda item: (rank[unit(item)], order[id(item)]))


def main(logs: list[str]) -> None:
    if not logs:
        sys.exit(__doc__)
    named: dict[str, list[float]] = {}
    for log in logs:
        with open(log, errors="replace") as f:
            found = durations_in_log(f.read())
        if not found:
            sys.exit(f"{log}: no `--durations` lines (run pytest with --durations=0)")
        for nodeid, took in found.items():
            named.setdefault(nodeid, []).append(took)
    seconds = {**read_durations(), **{nodeid: sum(took) / len(took) for nodeid, took in named.items()}}
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"],
                               cwd=os.path.dirname(os.path.dirname(DURATIONS_FILE)), capture_output=True, text=True)
    present = {line.strip() for line in collected.stdout.splitlines() if "::" in line}
    unnamed = present - set(seconds)  # pytest leaves out durations under 5 ms
    kept = {k: round(seconds.get(k, 0.0), 1) for k in sorted(present)}
    with open(DURATIONS_FILE, "w") as f:
        json.dump(kept, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"{DURATIONS_FILE}: {len(kept)} tests, {len(unnamed)} of them named by no log and recorded as 0 s")


if __name__ == "__main__":
    main(sys.argv[1:])
