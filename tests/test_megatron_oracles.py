"""Megatron's own pieces that lmfunc reproduces, checked against megatron-core itself (not against
formulas copied from it): the learning-rate schedules of ``OptimizerParamScheduler``, the loss
scale of ``DynamicGradScaler``, the MoE router's choice, weights and losses (``moe_utils``), and
``GPTDataset``'s indices and samples over an lmfunc-written ``.bin``/``.idx``, and the blend's
indices and per-dataset sizes. (Megatron's batch samplers live in Megatron-LM's training package,
not in megatron-core: they have no oracle here.)"""

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


@pytest.mark.parametrize("topk, score_function, pre_softmax, bias, groups, scaling", [
    (2, "softmax", False, False, None, None),
    (2, "softmax", True, False, None, None),
    (1, "softmax", False, False, None, None),
    (3, "sigmoid", False, True, None, 2.5),
    (2, "sigmoid", False, True, (4, 2), None),
    (4, "softmax", True, False, (4, 2), 1.5),
])
def test_routing_and_router_losses_equal_megatron_cores(topk, score_function, pre_softmax, bias, groups, scaling):
    """On random logits of 64 tokens over 16 experts: the chosen experts and their weights equal
    ``topk_routing_with_score_function``'s map and probabilities, and the load-balancing and z
    losses equal ``switch_load_balancing_loss_func`` and ``z_loss_func``."""
    from megatron.core.transformer.moe import moe_utils

    from lmfunc.model import router

    g = torch.Generator().manual_seed(topk * 7 + len(score_function))
    logits = torch.randn(64, 16, generator=g)
    expert_bias = 0.1 * torch.randn(16, generator=g) if bias else None
    num_groups, group_topk = groups or (None, None)
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling, score_function=score_function, expert_bias=expert_bias)
    ours = router.route(logits, topk, score_function, pre_softmax, expert_bias, num_groups, group_topk, scaling)
    our_map = torch.zeros(64, 16, dtype=torch.bool).scatter(1, ours.experts, True)
    our_probs = torch.zeros(64, 16).scatter(1, ours.experts, ours.weights)
    assert torch.equal(our_map, routing_map)
    assert torch.allclose(our_probs, probs, rtol=1e-6, atol=1e-7)

    scores, chosen = router.aux_loss_scores(logits, topk, score_function)
    their_map, their_scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function)
    assert torch.equal(chosen, their_map) and torch.allclose(scores, their_scores, rtol=1e-6, atol=1e-7)
    theirs = moe_utils.switch_load_balancing_loss_func(their_scores, their_map.sum(dim=0), 64, topk, 16, 0.01)
    assert float(router.load_balancing_loss(scores, chosen, topk, 0.01)) == pytest.approx(float(theirs), rel=1e-6)
    assert float(router.router_z_loss(logits, 1e-3)) == pytest.approx(float(moe_utils.z_loss_func(logits, 1e-3)), rel=1e-6)


class _Tokenizer:
    """What megatron-core's ``GPTDataset`` reads of a tokenizer (its ids for end of document and
    padding) when no masks are built from them."""

    eod, pad, vocab_size = 0, -1, 1000
    unique_identifiers = {"class": "test"}


@pytest.mark.parametrize("num_samples", [37, 500, 470])
def test_gpt_dataset_indices_and_samples_equal_megatron_cores(tmp_path, num_samples):
    """A ``.bin``/``.idx`` written by lmfunc, read by megatron-core's ``IndexedDataset`` and
    ``GPTDataset``: the document, sample and shuffle indices and every sample equal lmfunc's, for one
    epoch, for 13 epochs, and for 13 whose last is shuffled separately (470 samples: 7 of the last
    epoch's 38)."""
    import numpy as np
    from megatron.core.datasets.gpt_dataset import GPTDataset as TheirGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as TheirIndexedDataset
    from megatron.core.datasets.utils import Split

    from lmfunc.data.gpt_dataset import GPTDataset
    from lmfunc.data.indexed import IndexedDataset, IndexedDatasetBuilder

    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    draw = np.random.RandomState(0)
    for _ in range(40):
        builder.add_item(draw.randint(1, 1000, size=draw.randint(1, 60)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    seq = 31
    ids = np.arange(40, dtype=np.int32)
    ours = GPTDataset(IndexedDataset(prefix), ids, num_samples, seq, seed=1234)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=seq, split="1,0,0", tokenizer=_Tokenizer(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              path_to_cache=None)
    theirs = TheirGPTDataset(TheirIndexedDataset(prefix), prefix, ids, num_samples, Split.train, config)
    assert np.array_equal(ours.document_index, theirs.document_index)
    assert np.array_equal(ours.sample_index, theirs.sample_index)
    assert np.array_equal(ours.shuffle_index, theirs.shuffle_index)
    assert len(ours) == len(theirs) >= num_samples
    for i in range(len(ours)):
        assert np.array_equal(ours[i], theirs[i]["tokens"].numpy().tolist() + [theirs[i]["labels"][-1].item()]), i


@pytest.mark.parametrize("weights, size", [([0.3, 0.7], 1000), ([0.5, 0.2, 0.25, 0.05], 4321), ([1.0], 17)])
def test_blending_indices_and_sizes_equal_megatron_cores(weights, size):
    """The blend's dataset and per-dataset sample indices equal megatron-core's C++
    ``build_blending_indices`` (what its ``BlendedDataset`` builds), and the samples asked of each
    dataset equal its builder's split (``_get_size_per_split_per_dataset``, 0.5% surplus)."""
    import numpy as np
    from megatron.core.datasets import helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset

    from lmfunc.data.blend import blending_indices, component_sizes

    dataset_index, sample_index = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, np.array(weights, dtype=np.float64), len(weights),
                                   size, False)
    ours = blending_indices(weights, size)
    assert np.array_equal(ours[0], dataset_index) and np.array_equal(ours[1], sample_index)
    requested, _ = component_sizes(weights, size)
    assert requested == [per_split[0] for per_split in _get_size_per_split_per_dataset(weights, [size], surplus=0.005)]
