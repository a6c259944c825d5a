import math

import pytest
import torch

from lmfunc.optim import (
    adamw, apply_updates, chain, clip_by_global_norm, clip_by_global_norm_with_norm, decay_mask,
    scale_by_learning_rate, warmup_decay_schedule,
)
from lmfunc.tree import flatten_with_paths, tree_leaves


def make_params():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "layer": {"scale": torch.ones(5), "bias": torch.randn(5, generator=g), "v": torch.randn(5, 3, generator=g)},
    }


def test_adamw_matches_torch_optim_adamw_over_20_steps():
    max_lr, wd = 3e-2, 0.1
    schedule = warmup_decay_schedule(max_lr, min_lr=1e-3, warmup_steps=3, decay_steps=20, decay_style="cosine")
    params = make_params()
    tx = adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd)
    state = tx.init(params)

    reference = {name: leaf.clone().requires_grad_(True) for name, leaf in flatten_with_paths(params)}
    mask = dict(flatten_with_paths(decay_mask(params)))
    assert mask == {"w": True, "layer.scale": False, "layer.bias": False, "layer.v": True}
    torch_opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in reference.items() if mask[n]], "weight_decay": wd},
            {"params": [p for n, p in reference.items() if not mask[n]], "weight_decay": 0.0},
        ],
        lr=max_lr, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = {name: torch.randn(leaf.shape, generator=g) for name, leaf in reference.items()}
        for group in torch_opt.param_groups:
            group["lr"] = float(schedule(torch.tensor(step)))
        for name, leaf in reference.items():
            leaf.grad = grads[name].clone()
        torch_opt.step()
        grad_tree = {"w": grads["w"], "layer": {k: grads[f"layer.{k}"] for k in ("scale", "bias", "v")}}
        updates, state = tx.update(grad_tree, state, params)
        params = apply_updates(params, updates)
    for name, leaf in flatten_with_paths(params):
        torch.testing.assert_close(leaf, reference[name].detach(), rtol=0, atol=1e-6)
    assert int(state[0].count) == 20


MAX, MIN, W, D = 1.0, 0.1, 10, 110


@pytest.mark.parametrize(
    "style, mid",
    [
        ("linear", (MAX + MIN) / 2),
        ("cosine", MIN + 0.5 * (math.cos(math.pi * 0.5) + 1) * (MAX - MIN)),
        ("inverse-square-root", MAX * math.sqrt(W) / math.sqrt(60)),
        ("constant", MAX),
    ],
)
def test_schedules_match_megatron_formulas(style, mid):
    schedule = warmup_decay_schedule(MAX, MIN, W, D, style, warmup_init=0.05)
    at = lambda n: float(schedule(torch.tensor(n)))  # noqa: E731
    assert at(0) == pytest.approx(0.05)
    assert at(5) == pytest.approx(0.05 + (MAX - 0.05) * 0.5)
    assert at(W) == pytest.approx(MAX)
    assert at(60) == pytest.approx(mid, rel=1e-6)
    end = {"linear": MIN, "cosine": MIN, "inverse-square-root": MIN, "constant": MAX}[style]
    assert at(D + 5) == pytest.approx(end)
    if style in ("linear", "cosine"):
        assert at(D) == pytest.approx(MIN)
        assert at(35) == pytest.approx(MIN + (1 - 0.25 if style == "linear" else 0.5 * (math.cos(math.pi * 0.25) + 1)) * (MAX - MIN))


@pytest.mark.parametrize(
    "wsd_style, factor",
    [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5**0.5 - 1), ("minus_sqrt", 1 - 0.5**0.5)],
)
def test_wsd_schedule(wsd_style, factor):
    schedule = warmup_decay_schedule(MAX, MIN, W, D, "WSD", wsd_decay_steps=20, wsd_decay_style=wsd_style)
    at = lambda n: float(schedule(torch.tensor(n)))  # noqa: E731
    assert at(W) == pytest.approx(MAX)
    assert at(D - 20) == pytest.approx(MAX)
    assert at(D - 10) == pytest.approx(MIN + factor * (MAX - MIN), rel=1e-6)
    assert at(D) == pytest.approx(MIN, abs=1e-7)
    assert at(D + 1) == pytest.approx(MIN)


def test_schedule_errors_are_clear():
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_decay_schedule(1.0, warmup_steps=50, decay_steps=10)
    with pytest.raises(ValueError, match="decay_style"):
        warmup_decay_schedule(1.0, decay_steps=10, decay_style="cosinus")


def test_clip_follows_megatron_rule():
    grads = {"a": torch.tensor([3.0, 4.0]), "b": torch.zeros(2)}
    clipped, norm = clip_by_global_norm_with_norm(grads, 1.0)
    assert float(norm) == pytest.approx(5.0)
    torch.testing.assert_close(clipped["a"], torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))
    small, norm = clip_by_global_norm_with_norm(grads, 10.0)
    torch.testing.assert_close(small["a"], grads["a"], rtol=0, atol=0)
    tx = chain(clip_by_global_norm(1.0), scale_by_learning_rate(0.5))
    updates, _ = tx.update(grads, tx.init(grads), grads)
    torch.testing.assert_close(updates["a"], -0.5 * torch.tensor([3.0, 4.0]) / (5.0 + 1e-6))


def test_optimizer_state_is_a_tensor_pytree():
    tx = adamw(1e-3)
    state = tx.init(make_params())
    leaves = tree_leaves(state)
    assert leaves and all(isinstance(x, torch.Tensor) for x in leaves)
