"""Fault tolerance of ``python -m lmfunc.train`` on one process: SIGKILL and resume, SIGTERM, a crash
during a save, exit_interval, the model-shape check and finetuning. Runs are real subprocesses."""

import os
import signal
import subprocess
import sys
import time

import pytest

from lmfunc.checkpoint.manager import TRACKER, complete_steps, step_dir_name
from lmfunc.train.__main__ import main as train_main
from lmfunc.train.log import read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# About 25 ms per step on one thread, so a signal sent after step k lands well before step 20.
CONFIG = """
preset: tiny
model: {vocab_size: 384, hidden_size: 128, num_layers: 2, max_position_embeddings: 128}
data: {seq_length: 128, split: "90,10,0"}
optim: {lr_warmup_iters: 5}
run: {micro_batch_size: 4, global_batch_size: 8, train_iters: 20, eval_iters: 0, sample_tokens: 0, out_dir: "${RUNS}"}
log: {log_interval: 1, progress_bar: false, peak_flops: 1.0e+11}
checkpoint: {save_interval: 10, keep: null}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume")
    (path / "run.yaml").write_text(CONFIG)
    return path


def _command(workdir, name: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "lmfunc.train", "--config", str(workdir / "run.yaml"), "--run.name", name, *flags]


def _env(workdir) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", RUNS=str(workdir / "runs"))


def _run(workdir, name: str, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_command(workdir, name, *flags), env=_env(workdir), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(run_dir) -> dict[int, float]:
    """The loss logged for each step; a step run again after a resume keeps its last record."""
    return {r["step"]: r["loss"] for r in read_log(os.path.join(run_dir, "log.jsonl")) if r["kind"] == "train"}


def _interrupt(workdir, name: str, when, action, *flags: str) -> tuple[int, str]:
    """Start a run, call ``action(process)`` on the first stdout line for which ``when(line)`` holds
    (or when ``when(None)`` holds between lines), and return (exit code, output)."""
    proc = subprocess.Popen(_command(workdir, name, *flags), env=_env(workdir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if when(line):
            action(proc)
            break
    out = "".join(lines) + proc.stdout.read()
    return proc.wait(timeout=120), out


@pytest.fixture(scope="module")
def reference(workdir):
    """20 uninterrupted steps: the losses every interrupted-and-resumed run must reproduce."""
    _run(workdir, "reference")
    losses = _losses(workdir / "runs" / "reference")
    assert sorted(losses) == list(range(1, 21))
    return losses


def test_sigkill_then_resume_reproduces_every_loss_bit_for_bit(workdir, reference):
    run_dir = workdir / "runs" / "killed"
    code, out = _interrupt(workdir, "killed", lambda line: "saved checkpoint" in line and "iter_0000010" in line,
                           lambda proc: proc.send_signal(signal.SIGKILL))
    assert code == -signal.SIGKILL
    before = read_log(os.path.join(run_dir, "log.jsonl"))
    assert not any(r["kind"] == "end" for r in before), "the run finished before it was killed"
    assert complete_steps(run_dir / "checkpoints") == [10]

    resumed = _run(workdir, "killed")  # the same command again: resumes from the newest checkpoint
    assert "loaded checkpoint" in resumed.stdout and "step 10, 80 samples consumed" in resumed.stdout
    assert _losses(run_dir) == reference  # exact float equality, steps 1..20
    records = read_log(os.path.join(run_dir, "log.jsonl"))
    resume = [r for r in records if r["kind"] == "resume"]
    assert [(r["step"], r["consumed_samples"]) for r in resume] == [(10, 80)]
    consumed = {r["step"]: r["consumed_samples"] for r in records if r["kind"] == "train"}
    assert consumed == {step: 8 * step for step in range(1, 21)}  # the data order continues where it stopped


@pytest.mark.slow  # about 2 minutes; tests/test_checkpoint_parallel.py covers SIGTERM on 2 ranks by default
def test_sigterm_finishes_the_step_saves_and_exits_zero(workdir, reference):
    run_dir = workdir / "runs" / "terminated"
    began = []

    def terminate(proc):
        began.append(time.perf_counter())
        proc.send_signal(signal.SIGTERM)

    code, out = _interrupt(workdir, "terminated", lambda line: line.startswith("step      3/20"), terminate,
                           "--checkpoint.save-interval", "None")
    assert code == 0, out[-3000:]
    assert time.perf_counter() - began[0] < 60
    end = read_log(os.path.join(run_dir, "log.jsonl"))[-1]
    assert end["kind"] == "end" and end["exit_reason"] == "signal" and 3 <= end["step"] < 20
    assert complete_steps(run_dir / "checkpoints") == [end["step"]]
    assert open(run_dir / "checkpoints" / TRACKER).read().strip() == str(end["step"])

    _run(workdir, "terminated", "--checkpoint.save-interval", "None")
    assert _losses(run_dir) == reference


def _kill_during_a_save(workdir, name: str, *flags: str) -> str | None:
    """Start a run and SIGKILL it while a save is being written after a complete one (its .tmp
    directory exists, DCP's .metadata, written last, does not yet, and its step is newer than every
    complete save). Returns the unfinished save's directory name, or None when the save committed
    between the check and the kill (its .tmp directory is gone)."""
    save_dir = workdir / "runs" / name / "checkpoints"
    seen = []

    def mid_save(line):
        deadline = time.perf_counter() + 0.2
        while time.perf_counter() < deadline:
            if not os.path.isdir(save_dir):
                return False
            complete = complete_steps(save_dir)  # before the listing: a save may commit in between
            partial = [n for n in os.listdir(save_dir) if n.startswith("iter_") and n.endswith(".tmp")]
            # zero-padded names: a newer step sorts after the newest complete one
            if complete and partial and partial[0].removesuffix(".tmp") > step_dir_name(max(complete)):
                if os.path.isdir(save_dir / partial[0]) and not os.path.exists(save_dir / partial[0] / ".metadata"):
                    seen.append(partial[0])
                    return True
            time.sleep(0.0005)
        return False

    code, out = _interrupt(workdir, name, mid_save, lambda proc: proc.send_signal(signal.SIGKILL), *flags)
    assert code == -signal.SIGKILL, out[-2000:]
    return seen[0] if os.path.isdir(save_dir / seen[0]) else None


@pytest.mark.slow  # about 2 minutes
def test_kill_during_a_save_keeps_the_previous_checkpoint(workdir, reference):
    flags = ("--checkpoint.save-interval", "1", "--checkpoint.keep", "2")
    for attempt in range(3):  # a save can commit between the check and the kill: then try a new run
        name = f"crashed{attempt}"
        partial = _kill_during_a_save(workdir, name, *flags)
        if partial is not None:
            break
    assert partial is not None, "three runs committed their save before the kill landed"
    run_dir = workdir / "runs" / name
    save_dir = run_dir / "checkpoints"
    newest = max(complete_steps(save_dir))
    assert partial.removesuffix(".tmp") > step_dir_name(newest)

    resumed = _run(workdir, name, *flags)
    assert f"removed unfinished checkpoint saves in {save_dir}: {partial}" in resumed.stdout
    assert f"loaded checkpoint {save_dir}/iter_{newest:07d}: step {newest}," in resumed.stdout
    assert not any(entry.endswith(".tmp") for entry in os.listdir(save_dir))
    assert complete_steps(save_dir) == [19, 20]
    assert _losses(run_dir) == reference


def test_exit_interval_saves_then_stops_and_a_finished_run_resumes_to_nothing(workdir, reference):
    run_dir = workdir / "runs" / "intervals"
    _run(workdir, "intervals", "--run.exit-interval", "7", "--run.no-compile")
    end = read_log(os.path.join(run_dir, "log.jsonl"))[-1]
    assert (end["exit_reason"], end["step"]) == ("exit_interval", 7)
    assert complete_steps(run_dir / "checkpoints") == [7]
    assert _losses(run_dir) == pytest.approx({k: v for k, v in reference.items() if k <= 7}, rel=1e-5)


def test_a_different_hidden_size_is_refused_by_name(workdir, reference, capsys, monkeypatch):
    monkeypatch.setenv("RUNS", str(workdir / "runs"))
    load = str(workdir / "runs" / "reference" / "checkpoints")
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", str(workdir / "run.yaml"), "--run.name", "wider", "--model.hidden-size", "256",
                    "--checkpoint.load", load, "--run.no-compile"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model.hidden_size: checkpoint 128, this run 256" in err and "iter_0000020" in err
    with pytest.raises(SystemExit):
        train_main(["--config", str(workdir / "run.yaml"), "--run.name", "more", "--model.num-layers", "4",
                    "--model.num-attention-heads", "8", "--checkpoint.load", load, "--run.no-compile"])
    err = capsys.readouterr().err
    assert "model.num_attention_heads: checkpoint 4, this run 8" in err and "model.num_layers: checkpoint 2, this run 4" in err
    with pytest.raises(SystemExit):
        train_main(["--config", str(workdir / "run.yaml"), "--run.name", "absent", "--checkpoint.load",
                    str(workdir / "nowhere"), "--run.no-compile"])
    assert "holds no complete lmfunc checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a named run that exists and has no checkpoint to resume
        train_main(["--config", str(workdir / "run.yaml"), "--run.name", "reference", "--checkpoint.no-resume"])
    assert "already holds a run" in capsys.readouterr().err


def test_finetune_loads_weights_only(workdir, reference, monkeypatch):
    monkeypatch.setenv("RUNS", str(workdir / "runs"))
    load = str(workdir / "runs" / "reference" / "checkpoints")
    train_main(["--config", str(workdir / "run.yaml"), "--run.name", "finetuned", "--checkpoint.load", load,
                "--checkpoint.load-step", "10", "--checkpoint.finetune", "--run.train-iters", "3", "--optim.lr-warmup-iters", "1",
                "--run.no-compile"])
    records = read_log(str(workdir / "runs" / "finetuned" / "log.jsonl"))
    resume = next(r for r in records if r["kind"] == "resume")
    assert resume["step"] == 0 and resume["finetune"] and resume["checkpoint"].endswith("iter_0000010")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and train[0]["lr"] == 0.0  # a fresh schedule and optimizer
    assert train[0]["loss"] < reference[1] - 1.0  # but trained weights: far below the loss at initialisation
