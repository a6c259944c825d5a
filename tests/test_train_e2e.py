"""``python -m lmfunc.train`` end to end (in-process through the same ``main``)."""

import json
import os
import time

import pytest
from torch._dynamo.utils import counters

from lmfunc.config.yaml_io import load_config
from lmfunc.generate import generate, load_run
from lmfunc.generate import main as generate_main
from lmfunc.plan.megatron import flops_per_token
from lmfunc.train.__main__ import main as train_main
from lmfunc.train.cli import parse_args
from lmfunc.train.log import read_log

TINY_YAML = """
preset: tiny
model: {vocab_size: 384}
data: {seq_length: 32, split: "80,20,0"}
optim: {lr: 3e-3, min_lr: 3e-4, lr_warmup_iters: 5}
run: {micro_batch_size: 4, global_batch_size: 8, eval_interval: 10, eval_iters: 2, train_iters: 30, out_dir: "${RUNS}"}
log: {log_interval: 5, progress_bar: false, peak_flops: 1.0e+11}
"""


@pytest.fixture
def tiny_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return str(path)


def test_yaml_plus_override_trains_logs_and_reloads(tiny_yaml, tmp_path, capsys, recwarn):
    argv = ["--config", tiny_yaml, "--run.name", "e2e", "--run.sample-tokens", "16", "--log.tensorboard"]
    counters.clear()
    train_main(argv)
    run_dir = str(tmp_path / "runs" / "e2e")
    out = capsys.readouterr().out + capsys.readouterr().err

    # The train step and the eval step, each traced once (or loaded from an earlier run's saved
    # step: traced zero times), with no graph breaks and no recompiles.
    assert counters["stats"]["unique_graphs"] <= 2 and not counters["graph_break"]
    assert not [w for w in recwarn if "precompiled step" in str(w.message)]

    records = read_log(os.path.join(run_dir, "log.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in valid] == [0, 10, 20, 30]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert valid[-1]["loss"] < valid[0]["loss"] - 1.5
    assert all(b["loss"] < a["loss"] for a, b in zip(valid, valid[1:]))
    cfg = parse_args(argv)
    for r in train:  # MFU from the config's FLOPs per token and the configured peak
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops_per_token(cfg.model, 32) / 1e11)
        assert r["grad_norm"] > 0 and r["lr"] > 0 and r["mem_peak_rss_mib"] > 0
    end = records[-1]
    assert end["kind"] == "end" and end["consumed_samples"] == 240 and end["sample"].startswith("The ")
    assert "validation at step 30" in out and "MFU" in out and "resolved config:" in out

    assert load_config(os.path.join(run_dir, "config.yaml")) == cfg
    events = os.listdir(os.path.join(run_dir, "tensorboard"))
    assert any(name.startswith("events.out.tfevents") for name in events)

    generate_main(["--run", run_dir, "--prompt", "The ", "--max-new-tokens", "12", "--temperature", "0"])
    model_cfg, params = load_run(run_dir)
    expected = generate(params, model_cfg, list(b"The "), 12, temperature=0.0)
    assert capsys.readouterr().out.rstrip("\n") == bytes(t for t in expected.tolist() if t < 256).decode(errors="replace")


def test_sample_based_run_with_rampup_and_eager_steps(tiny_yaml, tmp_path):
    argv = ["--config", tiny_yaml, "--run.name", "ramp", "--run.no-compile", "--run.train-iters", "None",
            "--run.train-samples", "96", "--run.rampup-batch-size", "4", "4", "24", "--run.micro-batch-size", "4",
            "--optim.lr-warmup-iters", "0", "--optim.lr-warmup-samples", "16", "--log.log-interval", "1",
            "--run.eval-iters", "0", "--run.sample-tokens", "0", "--checkpoint.no-save-weights"]
    train_main(argv)
    records = read_log(str(tmp_path / "runs" / "ramp" / "log.jsonl"))
    sizes = [r["global_batch_size"] for r in records if r["kind"] == "train"]
    assert sizes == [4] * 6 + [8] * 9  # one increment per 24 samples: 4 until 24 are consumed, then 8
    assert records[-1]["consumed_samples"] == 96
    assert not os.path.exists(tmp_path / "runs" / "ramp" / "model.safetensors")


def test_fp16_mtp_recompute_and_param_groups_from_the_command_line(tiny_yaml, tmp_path, capsys):
    argv = ["--config", tiny_yaml, "--run.name", "numerics", "--run.no-compile", "--precision.compute-dtype", "fp16",
            "--log.grad-underflow-interval", "10",
            "--precision.initial-loss-scale", "65536", "--precision.loss-scale-window", "10",
            "--model.mtp-num-layers", "2", "--model.recompute-granularity", "full", "--optim.decoupled-lr", "1e-2",
            "--optim.scale-lr-patterns", "*.mlp.*", "--optim.lr-mult", "0.5", "--run.no-calculate-per-token-loss",
            "--run.sample-tokens", "0"]
    cfg = parse_args(argv)
    assert cfg.precision.loss_scaling().growth_interval == 10 and cfg.optim.scale_lr_patterns == ("*.mlp.*",)
    train_main(argv)
    records = read_log(str(tmp_path / "runs" / "numerics" / "log.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    assert {"mtp_1_loss", "mtp_2_loss", "loss_scale", "skipped_steps"} <= set(train[-1])
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert train[-1]["mtp_2_loss"] < train[0]["mtp_2_loss"]
    assert train[-1]["loss_scale"] >= 65536  # clean steps grow the scale every 10 steps
    assert train[-1]["skipped_steps"] < 5
    # Every log line (every 5 steps) shows the scaler's state; underflow is measured at 1, 10, 20, 30.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "|" in line]
    assert len(lines) == 6 and all("loss scale" in line and "skipped steps" in line for line in lines)
    underflow = [r for r in records if r["kind"] == "underflow"]
    assert [r["step"] for r in underflow] == [1, 10, 20, 30]
    assert all(0 <= r["all"] <= 1 for r in underflow) and underflow[0]["loss_scale"] == 65536
    assert {"embedding", "attention", "mlp", "norms", "all", "overflow"} <= set(underflow[0])


def test_exit_duration_stops_early(tiny_yaml, tmp_path):
    train_main(["--config", tiny_yaml, "--run.name", "short", "--run.no-compile", "--run.exit-duration-in-mins",
                "1e-6", "--run.eval-iters", "0", "--run.sample-tokens", "0"])
    end = read_log(str(tmp_path / "runs" / "short" / "log.jsonl"))[-1]
    assert end["exit_reason"] == "exit_duration_in_mins" and end["step"] == 1


@pytest.mark.parametrize("flags, calls", [([], [()]), (["--run.no-keep-host-memory"], [])])
def test_the_run_keeps_freed_host_memory_unless_told_not_to(tiny_yaml, monkeypatch, flags, calls):
    import lmfunc.train.loop

    made = []
    monkeypatch.setattr(lmfunc.train.loop, "keep_freed_host_memory", lambda *args: made.append(args))
    train_main(["--config", tiny_yaml, "--run.name", "keep", "--run.no-compile", "--run.train-iters", "2", "--optim.lr-warmup-iters", "1",
                "--run.eval-iters", "0", "--run.sample-tokens", "0", *flags])
    assert made == calls


def test_profiler_writes_a_chrome_trace_of_the_chosen_steps(tiny_yaml, tmp_path, capsys):
    train_main(["--config", tiny_yaml, "--run.name", "prof", "--run.no-compile", "--run.train-iters", "4", "--optim.lr-warmup-iters", "1",
                "--run.eval-iters", "0", "--run.sample-tokens", "0", "--log.profile", "--log.profile-step-start", "2",
                "--log.profile-step-end", "4"])
    path = tmp_path / "runs" / "prof" / "profile" / "rank0_steps2-3.json"
    assert f"profile of steps 2-3 written to {path}" in capsys.readouterr().out
    events = json.loads(path.read_text())["traceEvents"]
    names = [event.get("name") for event in events]
    assert names.count("aten::mm") > 0 and "aten::_foreach_add" in " ".join(map(str, names))
    assert all(len(e["args"]["Input Dims"]) == 2 for e in events if e.get("name") == "aten::mm")  # shapes recorded
    assert os.listdir(path.parent) == [path.name]
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--log.profile", "--log.profile-step-start", "3", "--log.profile-step-end", "3"])
    assert "log.profile_step_start (3) must be at least 1 and below log.profile_step_end (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--log.profile", "--log.profile-ranks", "0", "1"])
    assert "log.profile_ranks [0, 1]: rank(s) [1] do not exist in a world of 1 process(es)" in capsys.readouterr().err


def test_bad_settings_exit_with_a_message(tiny_yaml, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", tiny_yaml, "--run.global-batch-size", "6"])
    assert exit_info.value.code == 2
    assert "run.global_batch_size (6) is not divisible by run.micro_batch_size (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--model.vocab-size", "128"])
    assert "model.vocab_size (128) is smaller than the tokenizer's 258 ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--data.split", "1,0,0"])
    assert "data.split '1,0,0' leaves no validation data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--data.path", "0.5 a b"])
    assert "data.path '0.5 a b': weights don't parse" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--data.path", "nowhere/x"])
    assert "data.path: nowhere/x.idx does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--data.split", "0,0,0"])
    assert "data.split '0,0,0' must be one to three non-negative weights with a positive sum" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--data.seq-length", "600000", "--model.max-position-embeddings", "600000",
                    "--model.position-embedding-type", "rope"])
    assert "data.seq_length (600000) is longer than the split's" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--config", tiny_yaml, "--data.valid-path", "x"])
    assert "data.valid_path/data.test_path need data.train_path too" in capsys.readouterr().err


def test_trains_on_a_preprocessed_blend_and_on_mock_data(tiny_yaml, tmp_path):
    from lmfunc.data.corpus import embedded_documents
    from lmfunc.data.preprocess import main as preprocess_main

    docs = embedded_documents()
    for name, part in (("a", docs[:40]), ("b", docs[40:])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)
        preprocess_main(["--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name), "--append-eod"])
    blend = f"0.3 {tmp_path / 'a_text_document'} 0.7 {tmp_path / 'b_text_document'}"
    common = ["--config", tiny_yaml, "--run.no-compile", "--run.train-iters", "6", "--optim.lr-warmup-iters", "2",
              "--run.eval-interval", "3", "--run.sample-tokens", "0"]
    train_main(common + ["--run.name", "blend", "--data.path", blend])
    records = read_log(str(tmp_path / "runs" / "blend" / "log.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "valid"] == [0, 3, 6]
    assert any(name.endswith("BlendedDataset-train-description.txt") for name in os.listdir(tmp_path / "runs" / "cache"))
    train_main(common + ["--run.name", "split-paths", "--data.train-path", str(tmp_path / "b_text_document"),
                         "--data.valid-path", str(tmp_path / "a_text_document")])
    assert [r["kind"] for r in read_log(str(tmp_path / "runs" / "split-paths" / "log.jsonl"))].count("valid") == 3
    train_main(common + ["--run.name", "mock", "--data.mock"])
    assert read_log(str(tmp_path / "runs" / "mock" / "log.jsonl"))[-1]["kind"] == "end"


@pytest.mark.slow
def test_default_job_lowers_the_validation_loss(tmp_path):
    """The README's first command: ``python -m lmfunc.train`` on its defaults (about 2 minutes on 2 cores)."""
    train_main(["--run.out-dir", str(tmp_path), "--run.name", "default", "--log.no-progress-bar"])
    records = read_log(str(tmp_path / "default" / "log.jsonl"))
    valid = [r["loss"] for r in records if r["kind"] == "valid"]
    assert len(valid) == 4 and valid[0] > 5.0 and valid[-1] < 2.0
    assert records[-1]["kind"] == "end" and len(records[-1]["sample"]) > 100


def test_weights_and_biases_logs_offline(tiny_yaml, tmp_path, monkeypatch):
    """--log.wandb-project: rank 0 writes an offline W&B run (no network) holding the train records."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    save_dir = tmp_path / "wb"
    train_main(["--config", tiny_yaml, "--run.name", "wb", "--run.train-iters", "10", "--run.no-compile",
                "--run.sample-tokens", "0", "--log.wandb-project", "lmfunc-test", "--log.wandb-exp-name", "tiny",
                "--log.wandb-save-dir", str(save_dir)])
    runs = list((save_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    last = [r for r in read_log(str(tmp_path / "runs" / "wb" / "log.jsonl")) if r["kind"] == "train"][-1]
    wanted = (b"train/loss", json.dumps(last["loss"]).encode(), b"lmfunc-test")
    # W&B's writer is a service process of its own: once on a loaded CI machine the file held only
    # its 7-byte header when read right after the run's finish(), so the records get a minute to land
    deadline = time.monotonic() + 60
    while not all(w in runs[0].read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.5)
    data = runs[0].read_bytes()
    assert all(w in data for w in wanted), data[:200]


def test_wandb_without_the_package_is_a_clear_error(tiny_yaml, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", tiny_yaml, "--run.name", "nowb", "--log.wandb-project", "x"])
    assert exit_info.value.code == 2
    assert "log.wandb_project needs the wandb package: pip install wandb" in capsys.readouterr().err
