import math

import pytest
import torch

from lmfunc.config.yaml_io import train_config_from_dict
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.train.make_optimizer import build_lr_schedule


def test_constant_batch():
    plan = BatchPlan(micro_batch_size=4, global_batch_size=32, data_parallel_size=2)
    assert plan.num_microbatches_at(0) == 4 and plan.num_microbatches_at(10**6) == 4
    assert plan.train_iters_for_samples(1000) == 31  # the partial last batch is dropped


def test_rampup_follows_megatrons_calculator():
    # start 4, +4 per increment, over 100 samples to 16: 3 increments of 100/3 samples each.
    plan = BatchPlan(micro_batch_size=2, global_batch_size=16, rampup_batch_size=(4, 4, 100))
    sizes = [plan.global_batch_at(c) for c in plan.samples_before_steps(20)]
    assert sizes == [4] * 9 + [8] * 4 + [12] * 3 + [16] * 5
    assert plan.global_batch_at(33) == 4 and plan.global_batch_at(34) == 8 and plan.global_batch_at(101) == 16
    assert plan.num_microbatches_at(50) == 4
    # Megatron's update_train_iters: ramp phase while consumed <= 100, then whole global batches.
    assert plan.samples_before_steps(16)[-1] == 104
    assert plan.train_iters_for_samples(300) == 16 + (300 - 104) // 16
    assert plan.samples_before_steps(3) == [0, 4, 8, 12]


def test_iteration_schedule_is_megatrons_sample_schedule_divided_by_the_batch():
    cfg = train_config_from_dict({"run": {"train_iters": 100, "global_batch_size": 8},
                                  "optim": {"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 10}}).validate()
    lr = build_lr_schedule(cfg, BatchPlan.from_config(cfg.run), 100)
    assert float(lr(torch.tensor(0))) == 0.0  # Megatron: the first update runs at lr_warmup_init
    assert float(lr(torch.tensor(5))) == pytest.approx(0.5)
    assert float(lr(torch.tensor(55))) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert float(lr(torch.tensor(100))) == pytest.approx(0.1)


def test_sample_schedule_with_rampup_counts_consumed_samples():
    cfg = train_config_from_dict({
        "run": {"train_iters": None, "train_samples": 300, "micro_batch_size": 2, "global_batch_size": 16,
                "rampup_batch_size": [4, 4, 100]},
        "optim": {"lr": 1.0, "min_lr": 0.0, "lr_warmup_iters": 0, "lr_warmup_samples": 20, "lr_decay_style": "linear"},
    }).validate()
    plan = BatchPlan.from_config(cfg.run)
    iters = plan.train_iters_for_samples(300)
    lr = build_lr_schedule(cfg, plan, iters)
    consumed = plan.samples_before_steps(iters)
    for step in (0, 3, 5, 9, 12, iters - 1):
        n = consumed[step]  # Megatron evaluates the lr at the samples consumed before the step
        expected = n / 20 if n <= 20 else 1.0 - (n - 20) / (300 - 20)
        assert float(lr(torch.tensor(step))) == pytest.approx(expected, abs=1e-6), step
