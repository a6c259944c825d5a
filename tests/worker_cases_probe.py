"""A worker for tests/test_worker_cases.py: ``python -m tests.worker_cases_probe [--case WORD ...]...``
answers each case with its words, and raises for a case whose first word is ``fail``."""

import torch.distributed as dist

from tests.worker_cases import run_worker_cases


def run_case(args: list[str]) -> str:
    """The case's words, after a collective (as a real case ends); raises for ``fail``."""
    dist.barrier()
    if args and args[0] == "fail":
        raise AssertionError(f"rank {dist.get_rank()}: failed as asked")
    return " ".join(args)


if __name__ == "__main__":
    run_worker_cases(run_case)
