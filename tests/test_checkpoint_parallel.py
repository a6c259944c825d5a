"""Checkpoints across ranks and layouts (torchrun, gloo): SIGTERM on 2 ranks, resharding on load."""

import os
import signal
import subprocess

import pytest
import torch

from lmfunc.checkpoint.manager import complete_steps
from lmfunc.train.log import read_log
from tests.helpers import ROOT, run_torchrun, torchrun_command, torchrun_env

pytestmark = pytest.mark.multirank


COMMON = ["-m", "lmfunc.train", "--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32",
          "--run.train-iters", "20", "--optim.lr-warmup-iters", "2", "--run.eval-iters", "0", "--run.no-compile",
          "--log.no-progress-bar", "--log.log-interval", "1", "--run.micro-batch-size", "2",
          "--run.global-batch-size", "8", "--run.sample-tokens", "0", "--log.peak-flops", "1e11",
          "--checkpoint.save-interval", "5", "--checkpoint.keep", "None"]


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(os.path.join(run_dir, "log.jsonl")) if r["kind"] == "train"}


def _worker_of_rank(parent: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=``rank``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} under pid {parent}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 20-step run on dp_shard=2 that saves every 5 steps."""
    root = tmp_path_factory.mktemp("ckpt_parallel")
    run_torchrun(2, COMMON + ["--run.out-dir", str(root), "--data.cache-dir", str(root / "cache"),
                           "--run.name", "fsdp", "--parallel.dp-shard", "2"])
    assert complete_steps(root / "fsdp" / "checkpoints") == [5, 10, 15, 20]
    return root


def test_sigterm_to_one_rank_stops_both_after_the_same_step_and_resumes_exactly(runs, torchrun):
    args = COMMON + ["--run.out-dir", str(runs), "--data.cache-dir", str(runs / "cache"), "--run.name", "term",
                     "--parallel.dp-shard", "2", "--checkpoint.save-interval", "None"]
    proc = subprocess.Popen(torchrun_command(2, args), cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step      3/20"):
            os.kill(_worker_of_rank(proc.pid, 1), signal.SIGTERM)  # only rank 1 is told
            break
    lines.append(proc.stdout.read())
    assert proc.wait(timeout=120) == 0, "".join(lines)[-4000:]
    end = read_log(str(runs / "term" / "log.jsonl"))[-1]
    assert end["exit_reason"] == "signal" and 3 <= end["step"] < 20
    assert complete_steps(runs / "term" / "checkpoints") == [end["step"]]

    torchrun(2, args)
    assert _losses(runs / "term") == _losses(runs / "fsdp")  # bit-identical on the same layout


@pytest.mark.parametrize("layout, nproc", [("single", 1), ("tp=2", 2),
                                           pytest.param("dp_shard=2,tp=2", 4, marks=pytest.mark.slow)])
def test_a_dp_shard_checkpoint_loads_equal_on_other_layouts(runs, layout, nproc, tmp_path, torchrun):
    step_dir = str(runs / "fsdp" / "checkpoints" / "iter_0000010")
    torchrun(1, ["tests/checkpoint_worker.py", step_dir, "single", str(tmp_path / "reference.pt")])
    torchrun(nproc, ["tests/checkpoint_worker.py", step_dir, layout, str(tmp_path / "loaded.pt")])
    want, got = torch.load(tmp_path / "reference.pt"), torch.load(tmp_path / "loaded.pt")
    assert list(got) == list(want) and any(k.startswith("opt_state.0.mu.") for k in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert int(got["step"]) == 10 and int(got["consumed_samples"]) == 80


@pytest.mark.parametrize("name, nproc, flags", [("to_single", 1, []), ("to_tp", 2, ["--parallel.tp", "2"])])
def test_training_continues_on_another_layout(runs, name, nproc, flags, torchrun):
    reference = _losses(runs / "fsdp")
    torchrun(nproc, COMMON + ["--run.out-dir", str(runs), "--data.cache-dir", str(runs / "cache"), "--run.name", name,
                               "--checkpoint.load", str(runs / "fsdp" / "checkpoints"),
                               "--checkpoint.load-step", "10", *flags])
    continued = _losses(runs / name)
    assert sorted(continued) == list(range(11, 21))
    for step, loss in continued.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


MOE_FLAGS = ["--model.num-experts", "4", "--model.moe-ffn-hidden-size", "32", "--model.moe-router-topk", "2",
             "--model.moe-router-score-function", "sigmoid", "--model.moe-router-enable-expert-bias",
             "--model.moe-aux-loss-coeff", "0.01"]


@pytest.mark.slow  # 35 s of four torchrun jobs; the dp_shard SIGTERM resume above is the default tier's
def test_an_expert_parallel_checkpoint_resumes_exactly_and_loads_on_one_process(tmp_path, torchrun):
    """An MoE run on dp_shard 2 x ep 2 (each rank holds 2 of the 4 experts; the other leaves FSDP
    over both ranks): resumed from its step-3 checkpoint it gives the same losses, bit for bit;
    the step-6 state loaded on one process equals the same state loaded on the ep layout."""
    args = COMMON + MOE_FLAGS + ["--run.out-dir", str(tmp_path), "--data.cache-dir", str(tmp_path / "cache"),
                                 "--parallel.dp-shard", "2", "--parallel.ep", "2", "--run.train-iters", "6",
                                 "--checkpoint.save-interval", "3"]
    torchrun(2, args + ["--run.name", "ep"])
    torchrun(2, args + ["--run.name", "resumed", "--checkpoint.load", str(tmp_path / "ep" / "checkpoints"),
                        "--checkpoint.load-step", "3"])
    straight, resumed = _losses(tmp_path / "ep"), _losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == straight[s] for s in resumed), (straight, resumed)

    step_dir = str(tmp_path / "ep" / "checkpoints" / "iter_0000006")
    torchrun(1, ["tests/checkpoint_worker.py", step_dir, "single", str(tmp_path / "single.pt")])
    torchrun(2, ["tests/checkpoint_worker.py", step_dir, "dp_shard=2,ep=2", str(tmp_path / "ep.pt")])
    want, got = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "ep.pt")
    assert list(got) == list(want) and "params.layers.0.mlp.experts.w_gate" in got
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert float(want["params.layers.0.mlp.router.expert_bias"].abs().sum()) > 0  # the bias moved and was saved
