"""The README's Python tour and the notebooks run as written."""

import json
import os
import re
import shlex
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_tour_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert blocks, "README.md has no python block"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def executed_outputs(name: str) -> str:
    """Execute ``notebooks/NAME`` from the repository root (its asserts raise) and return the text
    its code cells printed."""
    notebook = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
    return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)


def test_functional_tour_notebook_executes():
    outputs = executed_outputs("01_functional_tour.ipynb")
    assert "Functions" in outputs and "grad norm" in outputs


def test_sharding_notebook_executes():
    outputs = executed_outputs("02_sharding.ipynb")
    assert "tile the 64 x 64 parameter exactly once" in outputs and "every count equals the theory" in outputs


@pytest.mark.slow  # about a minute: it compiles an fp16 train step
def test_mtp_and_loss_scaling_notebook_executes():
    outputs = executed_outputs("03_mtp_and_loss_scaling.ipynb")
    assert "one skipped step; the scale halved" in outputs and "max |grad difference|" in outputs


def readme_commands() -> list[list[str]]:
    """Every command line of the README's bash blocks, as argument lists (comments dropped, ``a && b``
    split in two)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


def train_arguments(command: list[str]) -> tuple[int, list[str]] | None:
    """``(processes, flags)`` of a ``python -m lmfunc.train`` or ``torchrun ... -m lmfunc.train`` command."""
    if command[:3] == ["python", "-m", "lmfunc.train"]:
        return 1, command[3:]
    if command[0] == "torchrun" and "lmfunc.train" in command:
        at = command.index("lmfunc.train")
        return int(command[command.index("--nproc-per-node") + 1]), command[at + 1:]
    return None


def test_every_readme_train_command_is_a_valid_config(monkeypatch):
    """Each documented ``lmfunc.train`` command parses and validates on its number of processes
    (the default global batch follows the data-parallel size)."""
    from lmfunc.train.cli import parse_args

    runs = [args for args in map(train_arguments, readme_commands()) if args is not None]
    assert len(runs) >= 12 and sum(n > 1 for n, _ in runs) == 6
    monkeypatch.chdir(ROOT)
    for processes, flags in runs:
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        cfg = parse_args(flags)
        assert cfg.run.global_batch_size % cfg.run.micro_batch_size == 0


SHORT_TRAIN_FLAGS = ["--run.train-iters", "2", "--optim.lr-warmup-iters", "1", "--run.eval-iters", "0",
                     "--run.sample-tokens", "0", "--run.no-compile", "--log.no-progress-bar", "--log.peak-flops", "1e11"]
"""Appended to each README training command: 2 eager steps (compiling is covered by the e2e tests)."""


def readme_folder(tmp_path) -> str:
    """``tmp_path`` with the inputs the README names: my_book.txt, corpus.jsonl and the configs."""
    from lmfunc.data.corpus import embedded_documents

    docs = embedded_documents()[:40]
    (tmp_path / "my_book.txt").write_text("\n\n".join(docs))
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    return str(tmp_path)


def run_readme_command(words: list[str], folder: str) -> str:
    """Run ``words`` in ``folder`` (lmfunc importable, one thread); assert it exits 0; its stdout."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(words, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(words)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.mark.slow
def test_every_single_process_readme_command_runs(tmp_path):
    """Every one-process README command of lmfunc.train (2 eager steps), lmfunc.data.preprocess and
    lmfunc.generate runs as written, in a folder with the inputs the README names (other_text_document
    made by a preprocess command of its own)."""
    folder = readme_folder(tmp_path)
    commands = readme_commands()
    preprocess = [c for c in commands if c[:3] == ["python", "-m", "lmfunc.data.preprocess"]]
    assert preprocess
    for words in preprocess:
        run_readme_command([sys.executable, *words[1:]], folder)
    run_readme_command([sys.executable, "-m", "lmfunc.data.preprocess", "--input", "corpus.jsonl", "--output-prefix", "other"],
                       folder)
    first_run = None
    for processes, flags in filter(None, map(train_arguments, commands)):
        if processes == 1:
            out = run_readme_command([sys.executable, "-m", "lmfunc.train", *flags, *SHORT_TRAIN_FLAGS], folder)
            assert "finished at step 2" in out
            first_run = first_run or re.search(r"run directory: (\S+)", out).group(1)
    generate = [c for c in commands if c[:3] == ["python", "-m", "lmfunc.generate"]]
    assert generate and first_run
    for words in generate:
        args = [w.replace("runs/<run>", first_run) for w in words[3:]]
        run_readme_command([sys.executable, "-m", "lmfunc.generate", *args[:-1], "5"], folder)


@pytest.mark.slow
@pytest.mark.multirank
def test_every_torchrun_readme_command_runs(tmp_path):
    """Every ``torchrun ... -m lmfunc.train`` README command (2 eager steps) runs as written. A
    multi-rank test of its own, so that it holds the multi-rank slot for its launches instead of
    keeping a single-process worker waiting for it."""
    folder = readme_folder(tmp_path)
    launches = [(n, flags) for n, flags in filter(None, map(train_arguments, readme_commands())) if n > 1]
    assert len(launches) == 6
    for processes, flags in launches:
        out = run_readme_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  str(processes), "-m", "lmfunc.train", *flags, *SHORT_TRAIN_FLAGS], folder)
        assert "finished at step 2" in out


def test_every_readme_plan_command_runs(capsys):
    """Each documented ``python -m lmfunc.plan`` command prints a plan (Megatron's numbers, then
    lmfunc's prediction, or the mark of a layout it does not predict or train yet)."""
    from lmfunc.plan.__main__ import main as plan_main

    commands = [c for c in readme_commands() if c[:3] == ["python", "-m", "lmfunc.plan"]]
    assert len(commands) >= 3
    for command in commands:
        plan_main(command[3:])
        out = capsys.readouterr().out
        assert "Theoretical memory footprints" in out and "FLOPs per iteration" in out
        assert "peak step memory" in out or "not trainable yet" in out or "does not model this layout yet" in out


REFUSED_MODEL_SETTINGS = [
    # (model settings on top of a preset, the phrase the plan's --help and docs/scale_out.md use);
    # the MLA cases take deepseek-v3-tiny's attention without its experts
    ("deepseek-v3-tiny", dict(num_experts=None, qk_layernorm=True), "MLA with QK-norm"),
    ("deepseek-v3-tiny", dict(num_experts=None, position_embedding_type="learned_absolute"), "learned positions"),
    ("deepseek-v3-tiny", dict(num_experts=None, add_bias_linear=True), "linear biases"),
    ("moe-small", dict(activation="gelu"), "non-SwiGLU experts"),
    ("moe-small", dict(add_bias_linear=True), "linear biases"),
    ("moe-small", dict(scan_layers=True), "scan_layers"),
]
"""Every model setting the trainer refuses (``lmfunc.config.model.unbuildable_features``)."""

TRAINABLE_LAYOUTS = [dict(dp_replicate=2), dict(dp_shard=2), dict(tp=2), dict(pp=2), dict(cp=2), dict(ep=2)]
"""Every mesh dim, each of which trains an MoE + MLA model (``deepseek-v3-tiny``) on 2 processes."""

REFUSAL_CLAIM = re.compile(
    r"\b(pp|cp|ep|tp|dp_shard|dp_replicate|MoE|MLA|pipeline|context|expert)\b[^.\n]{0,60}?"
    r"(must be 1|for now|can(not|'t) (be )?train(ed)? yet|not (be )?trainable yet|are refused|is refused)",
    re.IGNORECASE)


def _help_text(module_main, capsys) -> str:
    with pytest.raises(SystemExit):
        module_main(["--help"])
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())


def test_what_the_docs_say_is_refused_is_what_validation_refuses(capsys, monkeypatch):
    """The README, docs/scale_out.md and the ``--help`` of lmfunc.plan and lmfunc.train claim no
    parallel layout, MoE or MLA is refused while the trainer's validation accepts each
    (``TRAINABLE_LAYOUTS``); each model setting the validation refuses is refused by the trainer,
    planned by lmfunc.plan and named by the plan's help and docs/scale_out.md; and the refusals
    listed here are all that ``unbuildable_features`` finds in a model with every such setting."""
    import dataclasses

    from lmfunc.config import ConfigError, model_preset
    from lmfunc.config.model import unbuildable_features
    from lmfunc.config.parallel import ParallelConfig
    from lmfunc.config.train import DataConfig, RunConfig, TrainConfig
    from lmfunc.plan.__main__ import main as plan_main
    from lmfunc.train.cli import parse_args

    base = TrainConfig(model=dataclasses.replace(model_preset("deepseek-v3-tiny"), mtp_num_layers=0),
                       data=DataConfig(seq_length=64), run=RunConfig(micro_batch_size=1, global_batch_size=4))
    for layout in TRAINABLE_LAYOUTS:
        base.replace(parallel=ParallelConfig(**layout)).validate(2)
    plan_help = _help_text(plan_main, capsys)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    texts = {"plan --help": plan_help, "train --help": _help_text(parse_args, capsys)}
    for name in ("README.md", "docs/scale_out.md"):
        with open(os.path.join(ROOT, name)) as f:
            texts[name] = " ".join(f.read().split())
    for name, text in texts.items():
        claims = [m.group(0) for m in REFUSAL_CLAIM.finditer(text)]
        assert not claims, f"{name} says these are refused, but they train: {claims}"
    with open(os.path.join(ROOT, "docs/scale_out.md")) as f:
        scale_out = " ".join(f.read().split())
    for preset, settings, phrase in REFUSED_MODEL_SETTINGS:
        cfg = base.replace(model=dataclasses.replace(model_preset(preset), **settings))
        assert len(unbuildable_features(cfg.model)) == 1, (preset, settings)
        with pytest.raises(ConfigError, match="not implemented in this version of lmfunc"):
            cfg.validate(1)
        cfg.validate(1, planning=True)
        assert phrase in plan_help and phrase in scale_out, phrase
    everything = {preset: {} for preset, _, _ in REFUSED_MODEL_SETTINGS}
    for preset, settings, _ in REFUSED_MODEL_SETTINGS:
        everything[preset].update(settings)
    listed = len(REFUSED_MODEL_SETTINGS)
    found = sum(len(unbuildable_features(dataclasses.replace(model_preset(p), **s))) for p, s in everything.items())
    assert found == listed, "unbuildable_features refuses a setting this test does not list"


def test_every_library_module_stays_within_the_400_line_guide():
    """The guide's file size (aim < 400 lines): a module that outgrows it owns more than one idea."""
    over = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "lmfunc")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    lines = sum(1 for _ in f)
                if lines > 400:
                    over[os.path.relpath(os.path.join(folder, name), ROOT)] = lines
    assert not over, f"split these modules by what they own: {over}"
