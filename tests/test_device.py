"""Everything a run makes lives on its device: the train step, the state and the batches on the
``meta`` device, where any tensor created without ``device=`` (on the CPU) either fails the step or
shows up in the outputs; device selection; peak FLOPs for MFU."""

import dataclasses

import pytest
import torch

from lmfunc.config import ConfigError, model_preset
from lmfunc.config.train import DataConfig, OptimConfig, PrecisionConfig, RunConfig, TrainConfig
from lmfunc.metrics import peak_flops, table_peak_flops
from lmfunc.model.kv_cache import init_cache
from lmfunc.parallel.mesh import Layout, resolve_device
from lmfunc.precision import compute_dtype
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
from lmfunc.train.params import init_params
from lmfunc.train.run_data import global_batch_part
from lmfunc.train.state import TrainState
from lmfunc.train.step import make_train_step
from lmfunc.tree import tree_leaves

META = torch.device("meta")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_step_and_its_state_stay_on_the_device(dtype):
    """A sample-based run (its lr schedule looks the step up in a table), fp16 with dynamic loss
    scaling, MTP and dropout: every leaf of the state and every metric comes back on ``meta``."""
    cfg = TrainConfig(
        model=dataclasses.replace(model_preset("tiny"), mtp_num_layers=1, hidden_dropout=0.1),
        data=DataConfig(seq_length=16), optim=OptimConfig(lr_warmup_samples=8, lr_warmup_iters=0),
        precision=PrecisionConfig(compute_dtype=dtype), run=RunConfig(micro_batch_size=2, train_iters=None,
                                                                    train_samples=64),
    ).validate(1)
    plan = BatchPlan.from_config(cfg.run, 1)
    schedule = build_lr_schedule(cfg, plan, plan.train_iters_for_samples(64), device=META)
    params = init_params(cfg.model, None, seed=0, device=META)
    tx = build_optimizer(cfg, schedule, params)
    state = TrainState.create(params, tx, seed=0, loss_scale=cfg.precision.loss_scaling())
    step = make_train_step(cfg.model, tx, lr_schedule=schedule, compute_dtype=compute_dtype(dtype),
                           loss_scale=cfg.precision.loss_scaling(), compile=False)
    tokens = torch.zeros(2, 2, 16, dtype=torch.int64, device=META)
    for _ in range(2):
        state, metrics = step(state, {"tokens": tokens, "labels": tokens})
    leaves = [x for x in tree_leaves(state) + list(metrics.values()) if isinstance(x, torch.Tensor)]
    assert leaves and all(x.device == META for x in leaves), {x.device for x in leaves}


def test_batches_and_the_kv_cache_are_made_on_the_device():
    cfg = TrainConfig(model=model_preset("tiny"), data=DataConfig(seq_length=8), run=RunConfig(micro_batch_size=2))

    class Tokenizer:
        eod = 0

    dataset = [torch.arange(9).numpy() for _ in range(4)]
    batch = global_batch_part(dataset, 0, 1, cfg, Tokenizer(), Layout({"dp_replicate": 1, "dp_shard": 1}, None, META))
    assert {v.device for v in batch.values()} == {META}
    cache = init_cache(cfg.model, 1, 8, device=META)
    assert {x.device for x in tree_leaves(cache)} == {META}


def test_device_selection():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match=r"run.device is 'cuda' but no CUDA device is visible.*--run.device cpu"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="run.device must be 'auto', 'cpu' or 'cuda'"):
        resolve_device("tpu")


def test_gpu_peak_flops_table():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bf16", False) == (989.4e12, "H100 bf16 datasheet peak")
    assert table_peak_flops("NVIDIA H100 PCIe", "fp32", True) == (378e12, "H100 PCIe tf32 datasheet peak")
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "fp32", False)[0] == 19.5e12
    assert table_peak_flops("NVIDIA H200", "fp16", False)[0] == 989.4e12
    assert table_peak_flops("NVIDIA L40S", "bf16", False)[0] == 362.05e12
    assert table_peak_flops("Tesla T4", "bf16", False) is None
    assert peak_flops(torch.device("cpu"), "fp32", False, 5e9) == (5e9, "configured (log.peak_flops)")


class RecordingLogger:
    """The two ``RunLogger`` methods ``MemoryWatch.report`` calls, keeping what it echoes and records."""

    def __init__(self):
        self.lines, self.records = [], []

    def echo(self, line):
        self.lines.append(line)

    def record(self, kind, step, **values):
        self.records.append(values)


def test_the_cuda_memory_report_restarts_its_peak_after_the_first_step(monkeypatch):
    """The first step's CUDA peak includes compiling; the end report must be the steps' own peak."""
    from lmfunc.plan import make_plan
    from lmfunc.train.memory_watch import MemoryWatch

    peaks, resets = iter([300 * 2**20, 200 * 2**20]), []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(peaks))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 400 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(a))

    cfg = TrainConfig(model=model_preset("tiny"), data=DataConfig(seq_length=8), run=RunConfig(micro_batch_size=2))
    watch, logger = MemoryWatch(make_plan(cfg.validate(1), 1), torch.device("cuda")), RecordingLogger()
    first = watch.report(logger, 1, "first step")
    assert len(resets) == 1
    end = watch.report(logger, 9, "end")
    assert len(resets) == 1 and (first["cuda_peak_allocated_mib"], end["cuda_peak_allocated_mib"]) == (300.0, 200.0)
    assert "(compiling included) 300.0 MiB" in logger.lines[0] and "(since the first step) 200.0 MiB" in logger.lines[1]


def test_an_eager_run_is_told_that_the_prediction_is_the_compiled_steps():
    """The plan predicts the compiled step; an eager run's memory line must not read as a check of it."""
    from lmfunc.plan import make_plan
    from lmfunc.train.memory_watch import MemoryWatch

    cfg = TrainConfig(model=model_preset("tiny"), data=DataConfig(seq_length=8), run=RunConfig(micro_batch_size=2))
    plan = make_plan(cfg.validate(1), 1)
    compiled, eager = RecordingLogger(), RecordingLogger()
    MemoryWatch(plan, torch.device("cpu")).report(compiled, 1, "first step")
    MemoryWatch(plan, torch.device("cpu"), compiled=False).report(eager, 1, "first step")
    assert "predicted step peak" in compiled.lines[0] and "eager" not in compiled.lines[0]
    assert eager.lines[0].endswith("(the plan is the compiled step's; this eager step keeps more)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the device path itself is tested on "
                    "the meta device above; docs/performance.md has the GPU recipe")
def test_training_on_cuda(tmp_path):
    from lmfunc.train.loop import train

    cfg = TrainConfig(model=model_preset("tiny", vocab_size=384), data=DataConfig(seq_length=32),
                      optim=OptimConfig(lr_warmup_iters=1),
                      run=RunConfig(micro_batch_size=2, train_iters=3, device="cuda", out_dir=str(tmp_path),
                                    sample_tokens=8, eval_iters=1))
    result = train(cfg)
    assert result.steps == 3 and result.sample is not None


def test_cpu_allocator_peak_counts_each_call_from_its_own_start():
    """The profiler's running total keeps bytes allocated under an earlier call and freed after it;
    each call's peak must count from its own start (a second measurement in one process)."""
    from lmfunc.metrics import allocator_peak_bytes

    kept, first = allocator_peak_bytes(lambda: torch.ones(1 << 20))  # 4 MiB, freed after the call
    del kept

    def transient():
        scratch = torch.ones(1 << 19)  # 2 MiB, freed inside
        del scratch
        return float(torch.ones(1 << 18).sum())  # 1 MiB

    _, second = allocator_peak_bytes(transient)
    assert first == 4 * 2**20
    assert 2 * 2**20 <= second < 2 * 2**20 + 4096
