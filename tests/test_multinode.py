"""Two nodes on one machine: two torchrun agents meet through the c10d rendezvous (as on a cluster,
with 127.0.0.1 for the head node's address) and train the same losses as one node with the same
world size; a node stopped with SIGTERM checkpoints, and relaunching both resumes bit-exactly."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lmfunc.train.log import read_log
from tests.helpers import ROOT, run_torchrun, torchrun_env

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

COMMON = ["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "32", "--run.micro-batch-size", "2",
          "--optim.lr-warmup-iters", "1", "--run.eval-iters", "1", "--run.eval-interval", "3", "--run.sample-tokens", "0",
          "--run.no-compile", "--log.log-interval", "1", "--log.no-progress-bar", "--checkpoint.save-interval", "100"]
LAYOUTS = {
    "dp_shard_across_nodes": (1, ["--parallel.dp-shard", "2"]),
    "hsdp": (2, ["--parallel.dp-replicate", "2", "--parallel.dp-shard", "2"]),  # replicas across nodes, shards within
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(nproc_per_node: int, args: list[str], port: int, run_id: str) -> list[subprocess.Popen]:
    """One ``torchrun --nnodes 2 --node-rank N ... -m lmfunc.train ARGS`` per node, side by side (with a
    short exit barrier, ``tests/elastic_launcher.py``)."""
    procs = []
    for node in (0, 1):
        command = [sys.executable, "-m", "tests.elastic_launcher", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "-m", "lmfunc.train", *args]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 600, signalled: int = -1) -> list[str]:
    """The nodes' outputs once all exited 0, except node ``signalled``: a torchrun agent that gets
    SIGTERM forwards it to its workers, waits for them, and then exits 1 itself."""
    outputs = []
    for node, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0 or node == signalled, out[-5000:]
        outputs.append(out)
    return outputs


def losses(run_dir: str, kind: str = "train") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(os.path.join(run_dir, "log.jsonl")) if r["kind"] == kind}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_nodes_train_the_single_node_losses(layout, tmp_path):
    nproc, flags = LAYOUTS[layout]
    args = COMMON + flags + ["--run.train-iters", "4", "--run.out-dir", str(tmp_path)]
    run_torchrun(2 * nproc, ["-m", "lmfunc.train", *args, "--run.name", "one_node"])
    wait_all(start_nodes(nproc, args + ["--run.name", "two_nodes"], free_port(), f"{layout}-{os.getpid()}"))
    for kind in ("train", "valid"):
        one, two = losses(tmp_path / "one_node", kind), losses(tmp_path / "two_nodes", kind)
        assert sorted(one) == sorted(two) and len(one) >= 2
        for step in one:
            assert two[step] == pytest.approx(one[step], rel=1e-5)


def test_sigterm_on_one_node_checkpoints_and_both_resume_bit_exactly(tmp_path):
    nproc, flags = LAYOUTS["dp_shard_across_nodes"]
    args = COMMON + flags + ["--run.train-iters", "12", "--run.out-dir", str(tmp_path)]
    run_torchrun(2 * nproc, ["-m", "lmfunc.train", *args, "--run.name", "reference"])
    run_dir = tmp_path / "interrupted"
    log = run_dir / "log.jsonl"
    procs = start_nodes(nproc, args + ["--run.name", "interrupted"], free_port(), f"kill-{os.getpid()}")
    deadline = time.monotonic() + 300
    while not (log.exists() and any(r["kind"] == "train" and r["step"] >= 3 for r in read_log(str(log)))):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not reach step 3"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # torchrun forwards it to its worker
    outputs = wait_all(procs, signalled=1)
    assert "SIGTERM received" in outputs[1]
    ends = [r for r in read_log(str(log)) if r["kind"] == "end"]
    assert ends[-1]["exit_reason"] == "signal" and ends[-1]["step"] < 12
    stopped = ends[-1]["step"]
    outputs = wait_all(start_nodes(nproc, args + ["--run.name", "interrupted"], free_port(), f"resume-{os.getpid()}"))
    assert f"step {stopped}" in outputs[0] + outputs[1]
    reference, resumed = losses(tmp_path / "reference"), losses(run_dir)
    assert sorted(resumed) == list(range(1, 13))
    assert all(resumed[step] == reference[step] for step in reference), (resumed, reference)
