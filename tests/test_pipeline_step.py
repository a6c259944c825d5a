"""``lmfunc.train.pipeline_step`` against the one-process step: the same losses, gradient norms and
loss scales at every step and the same final params and Adam moments, per schedule
(``tests/pipeline_worker.py`` under torchrun, gloo; fp16 to a looser tolerance, see there). The
split-backward schedules run tied embeddings only without MTP (``check_schedule_model``): the
tied cases check that the last stage's output-layer gradient, which torch's split backward leaves as
a transposed view, is summed with the first stage's correctly over the embedding group. ``compiled``
compiles the stages and the update; ``recompute`` turns on full recompute and a chunked output
layer; ``mesh`` ("DP_SHARD TP SP [CP]") puts the pipeline beside dp_shard, tp or cp (pp 2 x 2 on 4
ranks), where the reference is the same layout without the pipeline; with cp the step splits every
sequence over cp in load-balanced order. The MoE and MLA cases run the same worker with ``--moe
--mla``. Compiled 1F1B runs beside dp_shard and beside tp with SP and recompute (its stages over
DTensors, without dropout: ``tests.pipeline_worker.hidden_dropout``); on a pipeline alone it is
``tests/test_train_pipeline.py``'s compiled run of the trainer and the compiled ZBV case here. One
case per schedule and mesh dimension: a schedule's code does not depend on the mesh beside it, nor
a mesh's on the schedule (pp 2 x cp 2 compiled, pp 2 x dp_shard 2 x tp 2 on 8 ranks and compiled
MoE stages are left out for the CI's time; docs/testing.md)."""

from typing import Optional

import pytest

from tests.worker_cases import Case, run_batched

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("nproc, schedule, virtual, mtp, tie, fp16, compiled, recompute, mesh", [
    (2, "1f1b", 0, 0, 1, 0, 0, 0, ""),
    (2, "interleaved-1f1b", 2, 1, 0, 0, 0, 0, ""),
    (2, "gpipe", 0, 1, 1, 0, 0, 1, ""),
    pytest.param(4, "gpipe", 0, 1, 1, 0, 0, 0, "1 2 1", marks=pytest.mark.slow),
    (2, "zero-bubble", 2, 0, 1, 0, 0, 0, ""),
    (4, "1f1b", 0, 1, 1, 0, 0, 0, "1 1 0 2"),
    pytest.param(4, "zero-bubble", 2, 0, 1, 0, 0, 0, "1 1 0 2", marks=pytest.mark.slow),
    pytest.param(4, "zero-bubble", 2, 1, 0, 0, 0, 0, "1 2 1", marks=pytest.mark.slow),
    pytest.param(2, "dualpipev", 0, 0, 1, 0, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(4, "1f1b", 0, 1, 1, 0, 0, 0, "2 1 0", marks=pytest.mark.slow),
    pytest.param(1, "gpipe", 0, 1, 1, 0, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(2, "gpipe", 0, 1, 1, 1, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(2, "zero-bubble", 2, 1, 0, 0, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(2, "zbv", 0, 1, 0, 0, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(4, "1f1b", 0, 1, 1, 0, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(4, "zero-bubble", 2, 1, 0, 0, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(4, "interleaved-1f1b", 2, 0, 0, 1, 0, 0, "", marks=pytest.mark.slow),
    pytest.param(2, "zbv", 0, 1, 0, 0, 1, 0, "", marks=pytest.mark.slow),
    pytest.param(4, "interleaved-1f1b", 2, 1, 0, 0, 0, 0, "2 1 0", marks=pytest.mark.slow),
    pytest.param(4, "gpipe", 0, 1, 1, 1, 0, 0, "1 2 0", marks=pytest.mark.slow),
    pytest.param(4, "1f1b", 0, 1, 1, 0, 1, 0, "2 1 0", marks=pytest.mark.slow),
    # compiled stages with recompute beside tp: the saved RNG state of the recomputed attention and
    # the saved DeviceMesh (lmfunc.compiler.saved_rng_states)
    pytest.param(4, "1f1b", 0, 1, 1, 0, 1, 1, "1 2 1", marks=pytest.mark.slow),
])
def test_a_pipeline_trains_like_one_process(nproc, schedule, virtual, mtp, tie, fp16, compiled, recompute, mesh,
                                            request):
    run_batched(request, worker_case)


@pytest.mark.parametrize("nproc, args", [
    (2, "1f1b 0 1 0 0 0 0"),
    pytest.param(2, "zero-bubble 2 0 0 0 0 0", marks=pytest.mark.slow),
    pytest.param(2, "interleaved-1f1b 2 1 0 0 0 0", marks=pytest.mark.slow),
    pytest.param(4, "1f1b 0 1 0 0 0 0 2 1 0 --ep=2", marks=pytest.mark.slow),
    pytest.param(4, "1f1b 0 1 1 0 0 0 1 1 0 2", marks=pytest.mark.slow),
])
def test_moe_and_mla_stages_train_like_one_process(nproc, args, request):
    """A model of two layers per stage (``tests/pipeline_worker.py``) with MLA attention, every
    second layer (and the MTP layer) an MoE layer (``tests.helpers.MOE_SETTINGS``: router losses,
    the expert bias, a shared expert), split over pipeline stages: each stage's router losses join
    its backward, and every stage's router statistics are summed over the pipeline, so the losses,
    grad norms, router metrics, expert biases, params and Adam moments are the one-process step's,
    as above. Slow cases: a split backward, virtual stages, and pp beside ep (the experts split over
    2 data-parallel ranks) and cp."""
    run_batched(request, worker_case)


def worker_case(item) -> Optional[Case]:
    """The worker case of a test of this file (``tests.worker_cases``): the eager ones of each size
    share one launch."""
    params = getattr(item, "callspec", None) and item.callspec.params
    if item.originalname == "test_a_pipeline_trains_like_one_process":
        args = [str(params[name]) for name in ("schedule", "virtual", "mtp", "tie", "fp16", "compiled", "recompute")]
        return Case("tests.pipeline_worker", params["nproc"], (*args, *params["mesh"].split()), not params["compiled"])
    if item.originalname == "test_moe_and_mla_stages_train_like_one_process":
        args = params["args"].split()
        return Case("tests.pipeline_worker", params["nproc"], (*args, "--moe", "--mla"), args[5] == "0")
    return None
