"""The dry run (``lmfunc.dryrun``) of a ``tests/parallel_worker.py`` run, to hold against what that
run measured."""

from __future__ import annotations

from lmfunc.compiler.gloo_reduce_scatter import as_if_gloo
from lmfunc.config.parallel import ParallelConfig
from lmfunc.dryrun import CapturedStep, collectives, trace
from lmfunc.dryrun.graph_report import differences_from_measured
from lmfunc.train import TrainState, make_train_step
from lmfunc.train.params import init_params
from tests.parallel_worker import worker_run


def dry_run_of_worker(argv: list[str], world_size: int) -> CapturedStep:
    """Rank 0's compiled step of the worker run ``argv`` (LAYOUT OUT.json [flags]) in a world of
    ``world_size``, traced on a fake process group with its reduce-scatters lowered as on gloo (an
    all-to-all and a sum: ``as_if_gloo``), as in the measured run."""
    run = worker_run(argv)
    sizes = ParallelConfig(**run.fields).sizes(world_size)

    def make(layout, backend):
        state = TrainState.create(init_params(run.cfg, layout.mesh, seed=0), run.tx,
                                  loss_scale=run.precision.get("loss_scale"))
        step = make_train_step(run.cfg, run.tx, compile=True, backend=backend, **run.precision)
        return step, state, run.local_batch(run.batches[-1], layout)

    with as_if_gloo():
        return trace(world_size, 0, sizes, make, microbatches=run.batches[-1]["tokens"].shape[0])


def assert_dry_run_equals_measured(result: dict, argv: list[str], world_size: int) -> None:
    """The dry run's collectives, counted per kind over every mesh dim, and the elements they send
    equal those the compiled run measured on rank 0 (``result["collectives"]``, ``["elements"]``);
    a kind whose sizes are known only at run time (the experts' token exchange) is held to its
    count (``graph_report.differences_from_measured``)."""
    uses = collectives(dry_run_of_worker(argv, world_size))
    differences = differences_from_measured(uses, result["collectives"], result["elements"])
    assert not differences, differences


def main(argv: list[str]) -> None:
    """``python -m tests.dryrun_check RESULT.json WORLD LAYOUT [flags]``: the dry run of the compiled
    worker run ``LAYOUT [flags]`` (``tests/parallel_worker.py``, already run with torchrun on WORLD
    ranks, rank 0's result in RESULT.json) beside what that run measured; exits 1 unless the two
    are equal (``graph_report.differences_from_measured``). For layouts too slow to launch in the test
    suite, such as a 3-D mix on 8 ranks (docs/scale_out.md)."""
    import json
    import sys

    if len(argv) < 3 or not argv[1].isdigit() or int(argv[1]) < 1:
        sys.exit(main.__doc__)
    result_path, world_size, worker_argv = argv[0], int(argv[1]), [argv[2], argv[0], *argv[3:]]
    try:
        result = json.loads(open(result_path).read())
        result["collectives"], result["elements"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        sys.exit(f"{result_path}: not a compiled worker run's result ({error}); run tests.parallel_worker "
                 "with --compile under torchrun first")
    print(f"{'collective':24s} {'over':10s} {'count':>6s} {'elements':>10s}")
    uses = collectives(dry_run_of_worker(worker_argv, world_size))
    for use in uses:
        print(f"{use.kind:24s} {use.dims:10s} {use.count:6d} {use.elements if use.elements is not None else '-':>10}")
    for kind, count in sorted(result["collectives"].items()):
        if count:
            print(f"measured {kind:24s} {count:6d} {result['elements'][kind]:>10}")
    differences = differences_from_measured(uses, result["collectives"], result["elements"])
    if differences:
        sys.exit(f"the dry run differs from the measured run: {differences}")
    print("the dry run's collectives and their elements equal the measured ones, kind by kind")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
