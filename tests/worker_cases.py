"""Several multi-rank cases in one torchrun launch.

Starting a launch costs about 7 s on 2 ranks and 12 s on 4 on a 2-core machine (torchrun, then
every rank importing torch and lmfunc and joining the gloo group) before a case does any work, more
than many eager cases take. So the tests of a worker's eager cases ask for their case through
``run_batched``: the first of them launches the worker once for every selected case of the same
worker and size, and each test then asserts on its own case's lines.

The worker side: ``python -m tests.WORKER --case ARGS... --case ARGS...`` runs each case with
``run_worker_cases`` in one process group and prints one line per case and rank, ``case I rank R
ok: MESSAGE``; a case that raises prints ``case I rank R FAILED: ERROR`` and its traceback, and the
launch stops there (another rank may be waiting in a collective the failed one never reaches), so
its later cases are reported as not run. Without ``--case`` the arguments are one case. A case
argument ``OUT`` (``OUT_ARG``) is replaced by a file of the launch's own for that case to write its
results to (``CaseResult.out``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import traceback
from typing import Callable, Optional

CASE_FLAG = "--case"
OUT_ARG = "OUT"


def split_cases(argv: list[str]) -> list[list[str]]:
    """``argv`` as a list of cases: the arguments between ``CASE_FLAG``s, or all of them as one."""
    if CASE_FLAG not in argv:
        return [list(argv)]
    cases: list[list[str]] = []
    for arg in argv:
        if arg == CASE_FLAG:
            cases.append([])
        elif not cases:
            raise SystemExit(f"arguments before the first {CASE_FLAG}: {argv}")
        else:
            cases[-1].append(arg)
    return cases


def run_worker_cases(run_case: Callable[[list[str]], str], argv: Optional[list[str]] = None) -> None:
    """Run each case of ``argv`` (default ``sys.argv[1:]``) with ``run_case(args) -> message`` in
    one gloo process group, printing each case's result line on this rank; exit 1 at the first
    case that raises. Exits without interpreter finalization (``exit_without_finalizing``)."""
    import torch.distributed as dist

    from lmfunc.train.__main__ import exit_without_finalizing

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for index, case in enumerate(split_cases(sys.argv[1:] if argv is None else argv)):
        try:
            message = run_case(case)
        except Exception as error:  # reported per case; the launch stops (see the module docstring)
            _write_line(f"case {index} rank {rank} FAILED: {type(error).__name__}: {error}")
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        _write_line(f"case {index} rank {rank} ok: {message}")
    dist.destroy_process_group()
    exit_without_finalizing()


def _write_line(line: str) -> None:
    """``line`` (its newlines made `` | ``) and a newline to stdout in one ``write``: the ranks share
    the launch's stdout pipe, unbuffered (``torchrun_env``), where ``print`` writes the text and
    its newline separately and another rank's line can land between them."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line.replace("\n", " | ")[:3000] + "\n").encode())


@dataclasses.dataclass(frozen=True)
class Case:
    """One test's worker case: ``python -m WORKER ARGS`` on ``nproc`` ranks; ``shared``: it may run
    in one launch with other shared cases of the same worker and size (eager ones: a compiled case
    runs alone, its compile is most of its time)."""

    worker: str
    nproc: int
    args: tuple[str, ...]
    shared: bool = True


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """A finished case: its ``rank R ok: MESSAGE`` lines and the file it was given for ``OUT_ARG``."""

    lines: list[str]
    out: pathlib.Path


_LINES: dict[Case, list[str]] = {}
"""Each case's result lines (``rank R ok: ...`` / ``rank R FAILED: ...``) from its launch, or the
reason the launch gave none."""
_OUT: dict[Case, pathlib.Path] = {}


def run_batched(request, case_of: Callable[[object], Optional[Case]]) -> CaseResult:
    """This test's case (``case_of(request.node)``), run, if no earlier test's launch ran it, in one
    launch with every selected test of this module whose ``Case`` is shared and has the same worker
    and size. Fails the test with the launch's output when a rank failed it or the launch stopped
    before it."""
    import subprocess

    import pytest

    from tests.helpers import run_torchrun_unchecked

    mine = case_of(request.node)
    if mine not in _LINES:
        batch = [mine]
        if mine.shared:
            for item in request.session.items:
                other = case_of(item) if item.module is request.node.module else None
                if (other is not None and other.shared and other not in _LINES and other not in batch
                        and (other.worker, other.nproc) == (mine.worker, mine.nproc)):
                    batch.append(other)
        folder = request.getfixturevalue("tmp_path_factory").mktemp("worker-cases")
        argv = []
        for index, case in enumerate(batch):
            _OUT[case] = folder / f"case{index}.json"
            argv += [CASE_FLAG, *(str(_OUT[case]) if arg == OUT_ARG else arg for arg in case.args)]
        timeout = 600 + 120 * (len(batch) - 1)
        try:
            proc = run_torchrun_unchecked(mine.nproc, ["-m", mine.worker, *argv], timeout=timeout)
            ended = f"exited {proc.returncode}"
        except subprocess.TimeoutExpired as expired:  # recorded, so the batch's other tests do not launch it again
            output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
            proc, ended = subprocess.CompletedProcess(expired.cmd, -9, output, ""), f"was killed after {timeout} s"
        for index, case in enumerate(batch):
            _LINES[case] = [match.group(1) for match in
                            re.finditer(rf"case {index} (rank \d+ (?:ok|FAILED): .*)$", proc.stdout, re.M)]
        if proc.returncode != 0:
            for case in batch:
                if not any(" FAILED: " in line for line in _LINES[case]) and len(_LINES[case]) < case.nproc:
                    _LINES[case].append(f"not finished: the launch {ended}")
            output = proc.stdout[-3000:] + proc.stderr[-5000:]
            for case in batch:
                if len(_LINES[case]) != case.nproc or any(" ok: " not in line for line in _LINES[case]):
                    _LINES[case].append(f"launch output:\n{output}")
    lines = _LINES[mine]
    ok = [line for line in lines if " ok: " in line and line.startswith("rank ")]
    if len(ok) != mine.nproc:
        pytest.fail("\n".join(lines) or "no result line", pytrace=False)
    return CaseResult(ok, _OUT[mine])
