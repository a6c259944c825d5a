"""Megatron's own pieces that lmfunc reproduces, checked against megatron-core itself (not against
formulas copied from it): the learning-rate schedules of ``OptimizerParamScheduler`` and the
loss scale of ``DynamicGradScaler``."""

import random

import pytest
import torch

from lmfunc.optim import warmup_decay_schedule
from lmfunc.precision import LossScaleConfig, init_loss_scale, update_loss_scale

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

WARMUP, DECAY = 7, 40


@pytest.mark.parametrize("style, wsd_style", [
    ("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
    ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "exponential"), ("WSD", "minus_sqrt"),
])
def test_lr_schedules_equal_megatron_cores_scheduler_at_every_step(style, wsd_style):
    """Every step from 0 to past the decay: lmfunc's schedule at step n equals megatron-core's
    ``OptimizerParamScheduler`` after ``step(n)`` (its steps counted with a global batch of one
    sample, so samples and steps coincide), to fp32 rounding."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    wsd_steps = 12 if style == "WSD" else None
    theirs = OptimizerParamScheduler(
        optimizer, init_lr=0.01, max_lr=0.3, min_lr=0.02, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
        lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=DECAY, wd_incr_style="constant",
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=wsd_style)
    ours = warmup_decay_schedule(0.3, 0.02, WARMUP, DECAY, style, warmup_init=0.01, wsd_decay_steps=wsd_steps or 0,
                                 wsd_decay_style=wsd_style or "exponential")
    for n in range(DECAY + 6):
        want = theirs.get_lr(optimizer.param_groups[0])
        assert float(ours(torch.tensor(n))) == pytest.approx(want, rel=1e-6, abs=1e-9), (style, n)
        theirs.step(1)


def test_loss_scale_follows_megatron_cores_dynamic_grad_scaler(monkeypatch):
    """A random run of 300 steps with overflows in bursts: lmfunc's scale equals megatron-core's
    ``DynamicGradScaler`` after every step (growth interval 5, hysteresis 3, a minimum the backoff
    reaches). megatron-core keeps its scale on CUDA; here its tensors are made on the CPU."""
    from megatron.core.optimizer import grad_scaler

    class CpuTorch:
        """``torch`` for megatron-core's scaler, with its ``device='cuda'`` tensors on the CPU."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(*args, device=None, **kwargs):
            return torch.tensor(*args, **kwargs)

    monkeypatch.setattr(grad_scaler, "torch", CpuTorch())
    cfg = LossScaleConfig(initial_scale=2.0**10, min_scale=4.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=5, hysteresis=3)
    theirs = grad_scaler.DynamicGradScaler(initial_scale=cfg.initial_scale, min_scale=cfg.min_scale,
                                           growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
                                           growth_interval=cfg.growth_interval, hysteresis=cfg.hysteresis)
    ours = init_loss_scale(cfg)
    draw = random.Random(0)
    overflowing, seen = False, set()
    for step in range(300):
        if draw.random() < 0.1:
            overflowing = not overflowing
        theirs.update(overflowing)
        ours = update_loss_scale(ours, torch.tensor(overflowing), cfg)
        assert float(ours.scale) == float(theirs.scale), step
        seen.add(float(ours.scale))
    assert cfg.min_scale in seen and max(seen) > cfg.initial_scale  # the run backed off to the floor and grew
