import dataclasses
import re

import pytest

from lmfunc.config import ConfigError, ModelConfig
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import load_config, save_config, train_config_from_dict
from lmfunc.train.cli import parse_args

YAML = """
preset: tiny
model:
  vocab-size: 384
data:
  seq_length: 64
optim:
  lr: 3e-4            # YAML reads this as a string; the float field converts it
run:
  out_dir: ${LMFUNC_TEST_OUT}/runs
  train_iters: ${LMFUNC_TEST_ITERS:-40}
  lr_unused: 1
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_preset_env_and_cli_override(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFUNC_TEST_OUT", "/data")
    path = write(tmp_path, YAML.replace("  lr_unused: 1\n", ""))
    cfg = parse_args(["--config", path, "--run.train-iters", "30", "--model.num-layers", "3",
                      "--optim.lr-warmup-iters", "5"])
    assert cfg.model.hidden_size == 64 and cfg.model.vocab_size == 384 and cfg.model.num_layers == 3
    assert cfg.optim.lr == 3e-4 and cfg.run.out_dir == "/data/runs" and cfg.run.train_iters == 30
    assert load_config(path).run.train_iters == 40  # the ${VAR:-default} default
    assert parse_args(["--preset", "gpt2-small", "--run.train-iters", "30"]).model.hidden_size == 768


def test_saved_config_reloads_identically(tmp_path):
    cfg = parse_args(["--preset", "tiny", "--model.vocab-size", "384", "--data.seq-length", "64", "--run.rampup-batch-size", "8", "8", "64",
                      "--run.train-iters", "None", "--run.train-samples", "640", "--run.global-batch-size", "16",
                      "--optim.lr-warmup-iters", "0", "--optim.lr-warmup-samples", "32"])
    path = str(tmp_path / "snapshot.yaml")
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert cfg.run.rampup_batch_size == (8, 8, 64)


def test_unset_environment_variable_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("LMFUNC_TEST_OUT", raising=False)
    with pytest.raises(ConfigError, match=r"run\.out_dir uses \$\{LMFUNC_TEST_OUT\}.*LMFUNC_TEST_OUT is not set"):
        load_config(write(tmp_path, YAML))


def test_unknown_yaml_keys_get_a_did_you_mean(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFUNC_TEST_OUT", "/data")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: unknown config key run\.lr_unused"):
        load_config(write(tmp_path, YAML))
    with pytest.raises(ConfigError, match=r"unknown config key model\.hiden_size.*did you mean model\.hidden_size\?"):
        train_config_from_dict({"model": {"hiden_size": 64}})
    with pytest.raises(ConfigError, match=r"unknown config key train_iters.*did you mean run\.train_iters\?"):
        train_config_from_dict({"train_iters": 10})
    with pytest.raises(ConfigError, match=r"optim\.lr_decay_style: 'cosin' is not one of .*did you mean 'cosine'\?"):
        train_config_from_dict({"optim": {"lr_decay_style": "cosin"}})
    with pytest.raises(ConfigError, match=r"run\.train_iters: expected int, got 'ten'"):
        train_config_from_dict({"run": {"train_iters": "ten"}})
    with pytest.raises(ConfigError, match=r"model\.moe_layer_freq must be an integer or a list, got 'x'"):
        train_config_from_dict({"model": {"moe_layer_freq": "x"}})
    freq = train_config_from_dict({"model": {"num_experts": 4, "moe_layer_freq": [0, 1, 1, 1]}}).model.moe_layer_freq
    assert freq == (0, 1, 1, 1) and train_config_from_dict({"model": {"moe_layer_freq": 2}}).model.moe_layer_freq == 2


def test_unknown_preset_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown model preset 'smal'; did you mean 'small'\?"):
        parse_args(["--preset", "smal"])
    with pytest.raises(ConfigError, match=r"unknown model preset 'tinny'; did you mean 'tiny'\?"):
        train_config_from_dict({"preset": "tinny"})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.hidden-size", "100", "--model.num-attention-heads", "3"],
         r"model\.hidden_size \(100\) is not divisible by model\.num_attention_heads \(3\)"),
        (["--model.num-attention-heads", "4", "--model.num-query-groups", "3"],
         r"model\.num_attention_heads \(4\) is not divisible by model\.num_query_groups \(3\)"),
        (["--run.global-batch-size", "10", "--run.micro-batch-size", "4"],
         r"run\.global_batch_size \(10\) is not divisible by run\.micro_batch_size \(4\) x data-parallel size \(1\)"),
        (["--run.train-iters", "10", "--optim.lr-warmup-iters", "20"],
         r"optim\.lr_warmup_iters \(20\) is longer than the decay .*run\.train_iters = 10"),
        (["--run.train-iters", "None", "--run.train-samples", "100", "--optim.lr-warmup-iters", "0",
          "--optim.lr-warmup-samples", "200"],
         r"optim\.lr_warmup_samples \(200\) is longer than the decay .*run\.train_samples = 100"),
        (["--run.rampup-batch-size", "4", "4", "100"], r"run\.rampup_batch_size needs a sample-based run"),
        (["--run.train-samples", "100"], r"set exactly one of run\.train_iters .* and run\.train_samples"),
        (["--parallel.tp", "2"], r"world size 1 is not divisible by the product of the other parallel sizes \(2\), so "
         r"parallel\.dp_shard \(unset: the rest of the world\) cannot fill it; launch a multiple of 2 processes"),
        (["--parallel.tp", "2", "--parallel.dp-shard", "1"],
         r"parallel sizes \(tp 2 = 2\) do not multiply to the world size 1; launch 2 processes"),
        (["--parallel.ep", "2"], r"parallel\.ep \(2\) must divide parallel\.dp_shard \(1, the rest of the world size 1\): "
         r"expert-parallel ranks are data-parallel ranks .*; launch more processes"),
        (["--parallel.ep", "2", "--parallel.dp-shard", "1"],
         r"parallel\.ep \(2\) must divide parallel\.dp_shard \(1\): .*set --parallel\.dp-shard to a multiple of it"),
        (["--parallel.tp", "0"], r"parallel\.tp must be a positive integer or -1 \(the rest of the world\), got 0"),
        (["--parallel.tp", "-1", "--parallel.dp-shard", "-1"], r"only one parallel size may be -1"),
    ],
)
def test_validation_errors_name_the_fields(flags, message, capsys):
    """Model fields are checked while tyro builds ModelConfig (it prints the error and exits 2);
    cross-field checks raise ConfigError from validate() (``python -m lmfunc.train`` prints it, exits 2)."""
    try:
        parse_args(flags)
    except ConfigError as err:
        text = str(err)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().err).split())
    else:
        pytest.fail(f"{flags} was accepted")
    assert re.search(message, text), text


def test_help_lists_every_field_with_its_docstring(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    for section in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else type(getattr(TrainConfig(), section.name))):
            flag = f"--{section.name}.{f.name.replace('_', '-')}"
            assert flag in text, flag
    docs = {"--model.hidden-size": "Model width h.", "--run.eval-iters": "Validation batches (of global_batch_size",
            "--optim.clip-grad": "Clip gradients to this global L2 norm", "--data.text-file": "A UTF-8 text file to train on"}
    for flag, doc in docs.items():
        assert doc in text, (flag, doc)
    assert "--config" in text and "--preset" in text


def test_model_fields_are_checked_when_built():
    with pytest.raises(ConfigError, match=r"model\.num_layers must be a positive integer"):
        train_config_from_dict({"model": {"num_layers": 0}})
    assert isinstance(train_config_from_dict({}).model, ModelConfig)


def test_shipped_configs_load_and_validate(monkeypatch):
    import glob
    import os

    monkeypatch.delenv("LMFUNC_RUNS", raising=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(glob.glob(os.path.join(root, "configs", "*.yaml")))
    assert paths
    for path in paths:
        load_config(path).validate()


def test_the_lr_schedule_lengths_are_resolved_in_one_place():
    """``schedule_lengths`` resolves warmup and decay (iterations or samples, the warmup fraction)
    for both the validation and the optimizer: the schedule's settings are its numbers."""
    from lmfunc.config.train import OptimConfig, RunConfig, schedule_lengths
    from lmfunc.train.make_optimizer import schedule_settings

    iters = TrainConfig(run=RunConfig(train_iters=100), optim=OptimConfig(lr_warmup_fraction=0.1, lr_decay_iters=80))
    samples = TrainConfig(run=RunConfig(train_iters=None, train_samples=640),
                          optim=OptimConfig(lr_warmup_iters=0, lr_warmup_samples=64, lr_decay_style="WSD",
                                            lr_wsd_decay_samples=128))
    assert schedule_lengths(iters.run, iters.optim) == ("iters", 8, 80, None)
    assert schedule_lengths(samples.run, samples.optim) == ("samples", 64, 640, 128)
    assert {k: v for k, v in schedule_settings(iters).items() if k.startswith("lr_") and "iters" in k} == {
        "lr_warmup_iters": 8, "lr_decay_iters": 80, "lr_wsd_decay_iters": None}
    assert schedule_settings(samples)["lr_wsd_decay_samples"] == 128
    with pytest.raises(ConfigError, match=r"optim\.lr_warmup_samples \(800\) is longer than the decay .* = 640"):
        dataclasses.replace(samples, optim=dataclasses.replace(samples.optim, lr_warmup_samples=800)).validate(1)
