"""Bad inputs and faults: every case ends with a one-line message that names the problem and the
fix, the right exit code, no traceback, and no change to any file the user had (the folders are
hashed before and after). Runs are tiny and eager, through ``python -m lmfunc.train``'s ``main``
(in-process) or a subprocess where the output stream itself is checked."""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from lmfunc.config import ConfigError
from lmfunc.checkpoint.manager import TRACKER, complete_steps
from lmfunc.export import main as export_main
from lmfunc.train.__main__ import main as train_main
from lmfunc.train.log import read_log
from lmfunc.train.run_lock import LOCK_FILE
from tests.helpers import ROOT

SMALL = ["--model.num-layers", "2", "--model.hidden-size", "64", "--data.seq-length", "64",
         "--model.max-position-embeddings", "64", "--run.micro-batch-size", "2", "--run.global-batch-size", "4",
         "--log.no-progress-bar", "--run.no-compile", "--optim.lr-warmup-iters", "1", "--run.eval-iters", "1",
         "--run.sample-tokens", "0", "--log.peak-flops", "1e11"]


def folder_hash(path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``path`` (directories as ``"dir"``)."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), path)] = "dir"
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), path)] = hashlib.sha256(f.read()).hexdigest()
    return found


def train(tmp_path, *flags: str, iters: int = 4) -> None:
    train_main([*SMALL, "--run.out-dir", str(tmp_path / "runs"), "--run.train-iters", str(iters), *flags])


def refused(capsys, call, code: int = 2) -> str:
    """Run ``call``; assert it exits with ``code`` and a one-line ``error:`` message; return it."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    return err[-1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 4-step run ``runs/a`` with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("faults")
    train(root, "--run.name", "a", "--checkpoint.save-interval", "2", "--checkpoint.no-async-save")
    assert complete_steps(root / "runs" / "a" / "checkpoints") == [2, 4]
    return root / "runs" / "a"


def copy_run(finished_run, tmp_path, name: str = "a"):
    target = tmp_path / "runs" / name
    shutil.copytree(finished_run, target)
    return target


# 1. A save_dir holding checkpoints lmfunc did not write is refused and left as it was.
def _megatron_legacy(d):
    (d / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (d / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"megatron")


def _megatron_dist(d):
    (d / "iter_0000100").mkdir(parents=True)
    (d / "iter_0000100" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (d / "iter_0000100" / "__0_0.distcp").write_bytes(b"shards")


def _unmarked(d):
    (d / "iter_0000030").mkdir(parents=True)
    (d / "iter_0000030" / "weights.pt").write_bytes(b"someone's")


@pytest.mark.parametrize("make, named", [
    (_megatron_legacy, "a Megatron legacy checkpoint: mp_rank_00/model_optim_rng.pt"),
    (_megatron_dist, "a Megatron distributed checkpoint, sharded_backend 'torch_dist'"),
    (_unmarked, "iter_0000030 (no lmfunc metadata.json"),
])
def test_a_save_dir_with_foreign_checkpoints_is_refused_untouched(tmp_path, capsys, make, named):
    save_dir = tmp_path / "ms"
    make(save_dir)
    (save_dir / TRACKER).write_text("100\n")
    before = folder_hash(save_dir)
    message = refused(capsys, lambda: train(tmp_path, "--checkpoint.save-dir", str(save_dir)))
    assert named in message and "--checkpoint.save-dir" in message
    assert folder_hash(save_dir) == before


# 2. One run per folder.
def _lock(run_dir, host: str, pid: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": host, "pid": pid, "started": 1.7e9}))


@pytest.mark.parametrize("host, why", [(socket.gethostname(), "still running"), ("node-7", "on another host")])
def test_a_locked_run_folder_is_refused_naming_the_holder(tmp_path, capsys, host, why):
    run_dir = tmp_path / "runs" / "b"
    _lock(run_dir, host, os.getpid())
    before = folder_hash(run_dir)
    message = refused(capsys, lambda: train(tmp_path, "--run.name", "b"))
    assert f"pid {os.getpid()} on host {host}" in message and why in message and LOCK_FILE in message
    assert folder_hash(run_dir) == before


def test_a_stale_lock_is_taken_over_and_the_lock_is_gone_after_the_run(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = tmp_path / "runs" / "c"
    _lock(run_dir, socket.gethostname(), gone.pid)
    train(tmp_path, "--run.name", "c", iters=2)
    assert f"took over the stale lock {run_dir / LOCK_FILE} (pid {gone.pid}" in capsys.readouterr().out
    assert not (run_dir / LOCK_FILE).exists() and (run_dir / "model.safetensors").exists()


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path, capsys):
    """The lock's pid runs (this test's process) but started at another time than the lock
    records: the pid was reused, the lock's run is gone, and the lock is taken over; with the
    matching start time it is refused."""
    from lmfunc.train.run_lock import acquire, process_start_ticks

    mine = process_start_ticks(os.getpid())
    if mine is None:
        pytest.skip("no /proc/<pid>/stat on this system: only the pid is checked")
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "started": 1.7e9}
    (tmp_path / LOCK_FILE).write_text(json.dumps(dict(lock, process_start=mine - 1)))
    taken = acquire(str(tmp_path))
    assert taken.taken_over and "that process is gone" in taken.taken_over
    assert json.loads((tmp_path / LOCK_FILE).read_text())["process_start"] == mine
    (tmp_path / LOCK_FILE).write_text(json.dumps(dict(lock, process_start=mine)))
    with pytest.raises(ConfigError, match="still running"):
        acquire(str(tmp_path))


def test_two_runs_started_together_one_is_refused(tmp_path):
    """Two real processes: the second finds the first's lock (the first runs long enough)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "lmfunc.train", *SMALL, "--run.out-dir", str(tmp_path / "runs"),
               "--run.name", "d", "--run.train-iters", "100000", "--checkpoint.no-save", "--log.log-interval", "1"]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if line.startswith("step "):
                break
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    finally:
        first.terminate()
        first.communicate(timeout=120)  # reads what it logs meanwhile: a full pipe would block it
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"pid {first.pid}" in second.stderr and "in use by another lmfunc run" in second.stderr
    ends = [r for r in read_log(tmp_path / "runs" / "d" / "log.jsonl") if r["kind"] == "end"]
    assert len(ends) == 1


# 3. Exports never overwrite what they did not write.
def test_export_refuses_a_run_folder_and_a_non_empty_folder(finished_run, tmp_path, capsys):
    other = copy_run(finished_run, tmp_path, "other")
    before = folder_hash(other)
    for flags in ([], ["--overwrite"]):
        message = refused(capsys, lambda: export_main(["--checkpoint", str(finished_run), "--out", str(other), *flags]))
        assert "holds a training run" in message and "with or without --overwrite" in message
    assert folder_hash(other) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    message = refused(capsys, lambda: export_main(["--checkpoint", str(finished_run), "--out", str(mine)]))
    assert "is not empty" in message and "--overwrite" in message
    assert os.listdir(mine) == ["notes.txt"]
    export_main(["--checkpoint", str(finished_run), "--out", str(mine), "--overwrite"])
    assert sorted(os.listdir(mine)) == ["config.yaml", "model.safetensors", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "keep me"


# 4 and 8. A refused resume writes nothing; the lr schedule follows Megatron's rules.
@pytest.mark.parametrize("flags, named", [
    (["--model.hidden-size", "128"], "model.hidden_size: checkpoint 64, this run 128"),
    (["--run.train-iters", "8"], "lr_decay_iters: checkpoint 4, this run 8"),
])
def test_a_refused_resume_changes_nothing(finished_run, tmp_path, capsys, flags, named):
    run_dir = copy_run(finished_run, tmp_path)
    before = folder_hash(run_dir)
    message = refused(capsys, lambda: train(tmp_path, "--run.name", "a", *flags))
    assert named in message
    if "lr_decay_iters" in named:
        assert "--optim.use-checkpoint-opt-param-scheduler" in message and "--optim.override-opt-param-scheduler" in message
    assert folder_hash(run_dir) == before


@pytest.mark.parametrize("flag, decay, saved", [("--optim.use-checkpoint-opt-param-scheduler", 4, "lr_decay_iters: 4"),
                                                ("--optim.override-opt-param-scheduler", 8, "lr_decay_iters: null")])
def test_a_longer_resume_takes_the_schedule_it_is_told_to(finished_run, tmp_path, capsys, flag, decay, saved):
    run_dir = copy_run(finished_run, tmp_path)
    train(tmp_path, "--run.name", "a", "--log.log-interval", "1", flag, iters=8)
    lrs = {r["step"]: r["lr"] for r in read_log(run_dir / "log.jsonl") if r["kind"] == "train"}
    # cosine from 2e-3 to 2e-4 after one warmup step: at step 4 of decay length 4 the minimum is reached
    assert (lrs[5] == pytest.approx(2e-4)) == (decay == 4)
    assert saved in (run_dir / "config.yaml").read_text()  # the config that repeats the run


# 5. A damaged newest checkpoint falls back to the previous one.
def _missing_shard(d):
    os.remove(d / "__0_0.distcp")


def _truncated_shard(d):
    data = (d / "__0_0.distcp").read_bytes()
    (d / "__0_0.distcp").write_bytes(data[: len(data) // 3])


def _missing_metadata(d):
    os.remove(d / ".metadata")


@pytest.mark.parametrize("damage, named", [(_missing_shard, "No such file or directory"),
                                           (_truncated_shard, "truncated"),
                                           (_missing_metadata, "has no DCP .metadata file")])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, capsys, damage, named):
    run_dir = copy_run(finished_run, tmp_path)
    damage(run_dir / "checkpoints" / "iter_0000004")
    train(tmp_path, "--run.name", "a")
    out = capsys.readouterr().out
    assert f"warning: checkpoint {run_dir / 'checkpoints' / 'iter_0000004'} is damaged" in out and named in out
    assert f"loaded checkpoint {run_dir / 'checkpoints' / 'iter_0000002'}: step 2" in out
    assert [r["step"] for r in read_log(run_dir / "log.jsonl") if r["kind"] == "end"] == [4, 4]


def test_a_damaged_checkpoint_does_not_count_toward_keep(finished_run, tmp_path, capsys):
    """Steps 2 and 4 saved (keep 2), step 4 damaged: the resume from step 2 saves step 3 and keeps
    the good step 2 beside it (the damaged 4 neither counts nor is deleted); the save of step 4
    then replaces the damaged one and the newest two good ones stay."""
    run_dir = copy_run(finished_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    _missing_shard(checkpoints / "iter_0000004")
    damaged = folder_hash(checkpoints / "iter_0000004")
    train(tmp_path, "--run.name", "a", "--checkpoint.save-interval", "1", "--checkpoint.keep", "2",
          "--run.exit-interval", "3")
    assert "not counted toward checkpoint.keep" in capsys.readouterr().out
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002", "iter_0000003", "iter_0000004"]
    assert folder_hash(checkpoints / "iter_0000004") == damaged
    train(tmp_path, "--run.name", "a", "--checkpoint.save-interval", "1", "--checkpoint.keep", "2",
          "--checkpoint.load-step", "3")
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert (checkpoints / "iter_0000004" / "__0_0.distcp").exists()


def test_no_loadable_checkpoint_is_one_line_that_points_to_load_step(finished_run, tmp_path, capsys):
    run_dir = copy_run(finished_run, tmp_path)
    _missing_shard(run_dir / "checkpoints" / "iter_0000004")
    _truncated_shard(run_dir / "checkpoints" / "iter_0000002")
    before = folder_hash(run_dir)
    message = refused(capsys, lambda: train(tmp_path, "--run.name", "a"))
    assert "no checkpoint in" in message and "--checkpoint.load-step" in message and "--checkpoint.no-resume" in message
    assert folder_hash(run_dir) == before


# 6, 7. Unwritable and full save folders.
def test_a_save_dir_that_cannot_be_written_is_refused_at_start(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    message = refused(capsys, lambda: train(tmp_path, "--checkpoint.save-dir", str(blocker / "ck")))
    assert "checkpoint.save_dir" in message and "is a file, not a directory" in message
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("log.jsonl"))


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_full_disk_mid_run_is_named_and_the_weights_are_still_written(tmp_path, capsys, monkeypatch, policy):
    import errno

    from lmfunc.checkpoint import manager

    real_save, calls = manager.save_tree, []

    def save_until_the_disk_is_full(tree, path, group=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tree, path, group)

    monkeypatch.setattr(manager, "save_tree", save_until_the_disk_is_full)
    run = lambda: train(tmp_path, "--run.name", "full", "--checkpoint.save-interval", "2",  # noqa: E731
                        "--checkpoint.no-async-save", "--checkpoint.on-save-error", policy, iters=6)
    if policy == "stop":
        message = refused(capsys, run, code=1)
    else:  # the step-6 save succeeds: the run ends well, the failure is in the output and the log
        run()
        message = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("error: "))
        assert "training goes on" in message
    save_dir = tmp_path / "runs" / "full" / "checkpoints"
    assert f"saving checkpoint step 4 to {save_dir} failed: no space left on {save_dir}" in message
    assert "MiB" in message and "the previous checkpoint (step 2) and the tracker are intact" in message
    log = read_log(tmp_path / "runs" / "full" / "log.jsonl")
    assert [r["step"] for r in log if r["kind"] == "checkpoint_failed"] == [4]
    assert [r["step"] for r in log if r["kind"] == "end"] == [4 if policy == "stop" else 6]
    assert complete_steps(save_dir) == ([2] if policy == "stop" else [2, 6])
    assert (save_dir / TRACKER).read_text() == ("2\n" if policy == "stop" else "6\n")
    assert (tmp_path / "runs" / "full" / "model.safetensors").exists()


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["prepare", "commit", "late-commit"])
def test_a_save_that_fails_on_rank_0_alone_stops_every_rank_together(tmp_path, where):
    """Two ranks, on_save_error stop; only rank 0's part of the step-2 save fails: preparing its
    folder (the other rank would wait in the save's collectives) or committing it, which rank 0
    finds at its own step, or only inside the next save while rank 1 is already in it
    (``late-commit``: both ranks must then raise in that save, or they deadlock). Every rank stops after the same step (the run ends with save_failed
    instead of hanging), the failure is named, and no checkpoint claims to be complete."""
    import signal

    from tests.helpers import kill_processes_mentioning, torchrun_command, torchrun_env

    proc = subprocess.Popen(torchrun_command(2, ["tests/save_failure_worker.py", str(tmp_path), where]), cwd=ROOT,
                            env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to the ranks (they run in sessions of their own)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # Ranks stuck in a collective ignore SIGTERM until their step ends, live in sessions of
            # their own and hold the output pipe: kill them by their command line, then read.
            os.killpg(proc.pid, signal.SIGKILL)
            kill_processes_mentioning(str(tmp_path))
            out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the ranks did not stop together (killed after 300 s):\n{out[-3000:]}")
    assert proc.returncode != 0, out[-3000:]
    assert f"saving checkpoint step 2 to {tmp_path / 'r' / 'checkpoints'} failed: no space left" in out, out[-3000:]
    ends = [r for r in read_log(tmp_path / "r" / "log.jsonl") if r["kind"] == "end"]
    assert len(ends) == 1 and ends[0]["exit_reason"] == "save_failed" and ends[0]["step"] < 6
    assert complete_steps(tmp_path / "r" / "checkpoints") == []


# 15, 17. Config checks.
def test_seq_length_beyond_max_position_embeddings_is_refused_under_rope(tmp_path, capsys):
    message = refused(capsys, lambda: train(tmp_path, "--model.max-position-embeddings", "32"))
    assert "data.seq_length (64) exceeds model.max_position_embeddings (32)" in message
    assert "--model.max-position-embeddings" in message


# 9, 10, 12, 13. Data inputs.
def _preprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmfunc.data.preprocess", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))


def _jsonl(path, n: int) -> None:
    from lmfunc.data.corpus import embedded_documents

    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in embedded_documents()[:n]))


def test_an_empty_jsonl_warns_at_preprocess_and_is_refused_by_training(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    proc = _preprocess("--input", str(tmp_path / "empty.jsonl"), "--output-prefix", str(tmp_path / "out" / "e"))
    assert proc.returncode == 0 and "warning: " in proc.stderr and "gave no tokens" in proc.stderr
    message = refused(capsys, lambda: train(tmp_path, "--data.path", str(tmp_path / "out" / "e_text_document")))
    assert "holds no tokens" in message and "was the input .jsonl empty?" in message


def test_preprocess_caps_workers_and_leaves_no_partial_files(tmp_path):
    _jsonl(tmp_path / "c.jsonl", 79)
    proc = _preprocess("--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c"), "--workers", "10000")
    assert proc.returncode == 0 and "--workers 10000 capped at" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "c_text_document.bin", "c_text_document.idx"]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    proc = _preprocess("--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--skip-bad-lines" in proc.stderr
    assert not [name for name in os.listdir(tmp_path) if name.startswith("bad_") or ".tmp-" in name]


def test_preprocess_into_a_folder_that_cannot_exist_is_one_line(tmp_path):
    _jsonl(tmp_path / "c.jsonl", 3)
    (tmp_path / "a-file").write_text("x")
    proc = _preprocess("--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "a-file" / "sub" / "c"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in proc.stderr


@pytest.mark.parametrize("flag, named", [("--config", "is a directory; pass a YAML file"),
                                         ("--data.text-file", "is a directory; pass one UTF-8 text file"),
                                         ("--run.out-dir", "is a file, not a directory")])
def test_path_mistakes_are_one_line(tmp_path, capsys, flag, named):
    target = tmp_path / "a-file" if flag == "--run.out-dir" else tmp_path
    (tmp_path / "a-file").write_text("x")
    message = refused(capsys, lambda: train(tmp_path, flag, str(target)) if flag != "--config"
                      else train_main(["--config", str(target)]))
    assert named in message


def test_a_bin_larger_than_its_idx_describes_is_refused(tmp_path, capsys):
    _jsonl(tmp_path / "c.jsonl", 20)
    assert _preprocess("--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c")).returncode == 0
    prefix = tmp_path / "c_text_document"
    with open(f"{prefix}.bin", "ab") as f:
        f.write(b"\0" * 64)
    message = refused(capsys, lambda: train(tmp_path, "--data.path", str(prefix)))
    assert "its .idx describes exactly" in message and "belongs to another (larger) dataset" in message


# 11. Skipped steps are not a silent success.
def test_a_run_of_skipped_steps_says_so_at_the_first_step_and_at_the_end(tmp_path, capsys):
    train(tmp_path, "--precision.compute-dtype", "fp16", "--precision.loss-scale", "1e30", "--checkpoint.no-save")
    out = capsys.readouterr().out
    assert "warning: step 1 overflowed in fp16 with the static loss scale 1e+30" in out
    assert "WARNING: 4 of this run's 4 steps were skipped" in out and "--precision.loss-scale" in out


# 14. Ctrl-C while the first step compiles.
def test_ctrl_c_is_acknowledged_at_once_and_a_second_one_stops_in_one_line(tmp_path):
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    flags = [flag for flag in SMALL if flag != "--run.no-compile"]
    proc = subprocess.Popen([sys.executable, "-m", "lmfunc.train", *flags, "--run.out-dir", str(tmp_path / "runs"),
                             "--run.train-iters", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        # The announcement "data: N train / ..." (not the resolved config's "data:" section, printed
        # before the handlers are installed): setup is done, the first (compiling) step starts.
        if re.match(r"data: \d+ train", line):
            break
    proc.send_signal(signal.SIGINT)
    # The acknowledgement's two lines, after whatever torch itself printed first (a CUDA build of
    # torch on a machine without a GPU warns "No CUDA runtime is found" as it loads its C++ tools).
    acknowledged = ""
    for _ in range(20):
        acknowledged += proc.stderr.readline()
        if "press Ctrl-C again to stop now" in acknowledged:
            break
    assert "stopping after the current step" in acknowledged and "press Ctrl-C again to stop now" in acknowledged
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: second SIGINT: stopped at once")


# 16. Generation mistakes name the real option.
def test_generate_messages_name_the_options(finished_run, tmp_path, capsys):
    from lmfunc.generate import main as generate_main

    message = refused(capsys, lambda: generate_main(["--run", str(finished_run), "--prompt", ""]))
    assert "--prompt is empty" in message
    message = refused(capsys, lambda: generate_main(["--run", str(finished_run), "--max-new-tokens", "100"]))
    assert "exceeds the model's context of 64 tokens" in message and "--max-new-tokens" in message
    weightless = copy_run(finished_run, tmp_path)
    os.remove(weightless / "model.safetensors")
    message = refused(capsys, lambda: generate_main(["--run", str(weightless)]))
    assert f"python -m lmfunc.export --checkpoint {weightless} --out DIR" in message


def test_final_weights_go_to_a_temporary_folder_when_the_run_folder_refuses_them(tmp_path):
    import torch

    from lmfunc.checkpoint import load_weights
    from lmfunc.config.train import CheckpointConfig, TrainConfig
    from lmfunc.train.log import RunLogger
    from lmfunc.train.run_checkpoints import RunCheckpoints

    lines = []
    cfg = TrainConfig().replace(checkpoint=CheckpointConfig(save=False))
    checkpoints = RunCheckpoints(cfg, str(tmp_path / "ck"), RunLogger(None, 1))
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    params = {"w": torch.arange(6.0).reshape(2, 3)}
    path = checkpoints.write_weights(params, str(blocked), step=7, echo=lines.append)
    assert path != str(blocked / "model.safetensors") and os.path.exists(path)
    assert f"cannot write {blocked / 'model.safetensors'}" in lines[0] and f"written to {path}" in lines[1]
    assert torch.equal(load_weights(path, {"w": torch.empty(2, 3)})["w"], params["w"])
    shutil.rmtree(os.path.dirname(path))
