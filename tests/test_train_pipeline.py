"""``python -m lmfunc.train`` with ``--parallel.pp`` (torchrun, gloo): the pipeline run trains and
evaluates like one process, alone and beside dp_shard or tp, resumes exactly from its own
checkpoint, and its checkpoint loads on other layouts and on one process, equal to the
consolidated state."""

import os

import pytest
import torch

from lmfunc.train.log import read_log
from tests.helpers import run_torchrun

pytestmark = pytest.mark.multirank

STEPS = 6
COMMON = ["-m", "lmfunc.train", "--preset", "tiny", "--model.num-layers", "4", "--model.no-scan-layers",
          "--model.vocab-size", "384", "--data.seq-length", "32", "--run.train-iters", str(STEPS),
          "--optim.lr-warmup-iters", "2", "--run.eval-iters", "2", "--run.eval-interval", "3", "--run.no-compile",
          "--log.no-progress-bar", "--log.log-interval", "1", "--run.micro-batch-size", "2",
          "--run.global-batch-size", "8", "--run.sample-tokens", "0", "--log.peak-flops", "1e11",
          "--checkpoint.save-interval", "3", "--checkpoint.keep", "None"]


def _losses(run_dir, kind: str = "train") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(os.path.join(run_dir, "log.jsonl")) if r["kind"] == kind}


def _train(root, name: str, nproc: int, *flags: str) -> str:
    run_torchrun(nproc, COMMON + ["--run.out-dir", str(root), "--data.cache-dir", str(root / "cache"),
                                  "--run.name", name, *flags])
    return str(root / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (the reference) and pp = 2 with 1F1B, each 6 steps with checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("pipeline_runs")
    _train(root, "single", 1)
    _train(root, "pp2", 2, "--parallel.pp", "2")
    return root


def _assert_like_one_process(runs, run_dir) -> None:
    for kind in ("train", "valid"):
        want, got = _losses(runs / "single", kind), _losses(run_dir, kind)
        assert sorted(got) == sorted(want) and len(want) >= (STEPS if kind == "train" else 3)
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), (kind, step)
    log = read_log(str(run_dir / "log.jsonl"))
    assert log[-1]["kind"] == "end" and log[-1]["exit_reason"] == "train_iters"


def test_pp2_trains_and_evaluates_like_one_process(runs):
    _assert_like_one_process(runs, runs / "pp2")


@pytest.fixture(scope="module")
def pp2_dp2(runs):
    """pp = 2 beside dp_shard = 2 (4 ranks; each pipeline rank's leaves FSDP-sharded, each data-parallel
    rank loading its half of every microbatch), 6 steps with checkpoints at 3 and 6."""
    return _train(runs, "pp2_dp2", 4, "--parallel.pp", "2", "--parallel.dp-shard", "2")


def test_pp2_beside_dp_shard2_trains_like_one_process(runs, pp2_dp2):
    _assert_like_one_process(runs, runs / "pp2_dp2")


def test_a_pp2_dp_shard2_checkpoint_continues_on_pp2_tp2_with_sequence_parallelism(runs, pp2_dp2, tmp_path):
    continued = _train(tmp_path, "continued", 4, "--parallel.pp", "2", "--parallel.tp", "2",
                       "--model.sequence-parallel", "--checkpoint.load", str(runs / "pp2_dp2" / "checkpoints"),
                       "--checkpoint.load-step", "3")
    want, got = _losses(runs / "single"), _losses(continued)
    assert sorted(got) == list(range(4, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_pp2_with_compiled_stages_and_update_trains_like_one_process(runs, tmp_path):
    """``run.compile`` on: each stage's forward and backward and the update compiled (the
    reference is the eager one-process run). Compiled stages beside dp_shard (the last stage's loss
    metrics DTensors returned by the compiled stage, its backward gathering the FSDP shards again:
    ``lmfunc.compiler.regather``), tp and cp are ``tests/test_pipeline_step.py``'s compiled cases,
    which also compare the parameters and Adam moments."""
    compiled = [flag for flag in COMMON if flag != "--run.no-compile"]
    run_torchrun(2, compiled + ["--run.out-dir", str(tmp_path), "--data.cache-dir", str(tmp_path / "cache"),
                                "--run.name", "compiled", "--parallel.pp", "2"])
    for kind in ("train", "valid"):
        want, got = _losses(runs / "single", kind), _losses(tmp_path / "compiled", kind)
        assert sorted(got) == sorted(want)
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), (kind, step)


def test_pp2_resumes_exactly_from_its_checkpoint(runs, tmp_path):
    resumed = _train(tmp_path, "resumed", 2, "--parallel.pp", "2", "--checkpoint.load",
                     str(runs / "pp2" / "checkpoints"), "--checkpoint.load-step", "3")
    want = _losses(runs / "pp2")
    got = _losses(resumed)
    assert sorted(got) == list(range(4, STEPS + 1))
    assert all(got[step] == want[step] for step in got), (got, want)  # bit-identical on the same layout


@pytest.mark.parametrize("nproc, flags", [
    (1, []),
    pytest.param(4, ["--parallel.pp", "4", "--parallel.pp-schedule", "gpipe"], marks=pytest.mark.slow),
])
def test_a_pp2_checkpoint_continues_on_another_pp_size(runs, tmp_path, nproc, flags):
    continued = _train(tmp_path, "continued", nproc, *flags, "--checkpoint.load", str(runs / "pp2" / "checkpoints"),
                       "--checkpoint.load-step", "3")
    want, got = _losses(runs / "single"), _losses(continued)
    assert sorted(got) == list(range(4, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.parametrize("layout, nproc", [("single", 1), pytest.param("pp=2,tp=2", 4, marks=pytest.mark.slow),
                                           pytest.param("pp=4", 4, marks=pytest.mark.slow)])
def test_a_pp2_checkpoint_loads_equal_on_other_layouts(runs, layout, nproc, tmp_path):
    step_dir = str(runs / "pp2" / "checkpoints" / "iter_0000006")
    run_torchrun(2, ["tests/checkpoint_worker.py", step_dir, "pp=2", str(tmp_path / "pp2.pt")])
    run_torchrun(nproc, ["tests/checkpoint_worker.py", step_dir, layout, str(tmp_path / "loaded.pt")])
    want, got = torch.load(tmp_path / "pp2.pt"), torch.load(tmp_path / "loaded.pt")
    assert set(got) == set(want) and any(k.startswith("opt_state.0.mu.layers.3.") for k in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert int(got["step"]) == STEPS and int(got["consumed_samples"]) == 8 * STEPS


def test_a_pp2_run_exports_to_hf_and_a_pp2_run_starts_from_the_import(runs, tmp_path):
    """The pp2 checkpoint exports as one HF model; a pp2 run with ``--checkpoint.load-hf`` starts
    from it (each rank keeps its leaves of the import): its first validation equals the exporting
    run's last (the same batches)."""
    from lmfunc.export import main as export_main

    export_main(["--checkpoint", str(runs / "pp2" / "checkpoints"), "--out", str(tmp_path / "hf"), "--format", "hf"])
    started = _train(tmp_path, "from_hf", 2, "--parallel.pp", "2", "--checkpoint.load-hf", str(tmp_path / "hf"))
    source = _losses(runs / "pp2", "valid")
    assert _losses(started, "valid")[0] == pytest.approx(source[STEPS], rel=1e-6)


@pytest.mark.slow
def test_the_deepseek_preset_trains_on_pp2_like_one_process(tmp_path):
    """``--preset deepseek-v3-tiny`` (MLA, a dense first layer, MoE layers with a shared expert and
    the expert bias, one MTP depth, whose layer is an MoE layer) through the CLI on pp 2: every
    step's loss, MTP loss and router metrics (each layer's too) equal one process's (rel 1e-5),
    as do the validation losses."""
    flags = ["-m", "lmfunc.train", "--preset", "deepseek-v3-tiny", "--data.seq-length", "32",
             "--run.micro-batch-size", "2", "--run.global-batch-size", "8", "--run.train-iters", "4",
             "--optim.lr-warmup-iters", "1", "--run.eval-iters", "1", "--run.eval-interval", "2", "--run.no-compile",
             "--log.no-progress-bar", "--log.log-interval", "1", "--run.sample-tokens", "0", "--log.peak-flops",
             "1e11", "--run.out-dir", str(tmp_path), "--data.cache-dir", str(tmp_path / "cache")]
    run_torchrun(1, flags + ["--run.name", "single"])
    run_torchrun(2, flags + ["--run.name", "pp2", "--parallel.pp", "2"])
    records = {name: [r for r in read_log(str(tmp_path / name / "log.jsonl")) if r["kind"] in ("train", "valid")]
               for name in ("single", "pp2")}
    assert len(records["pp2"]) == len(records["single"]) >= 6
    for want, got in zip(records["single"], records["pp2"]):
        keys = [k for k in want if k == "loss" or k.startswith(("mtp_", "moe_"))]
        assert "moe_imbalance/mtp.0.layer.mlp" in keys or want["kind"] == "valid", sorted(want)
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
