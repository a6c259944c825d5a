"""The output layer and cross entropy fused over token chunks equals the plain head."""

import dataclasses

import pytest
import torch

from lmfunc import model
from lmfunc.config import ConfigError, model_preset
from lmfunc.loss.chunked_output import chunked_output_layer_loss
from lmfunc.loss import lm_loss, masked_cross_entropy
from lmfunc.optim import adamw
from lmfunc.train import TrainState, make_train_step
from lmfunc.tree import tree_flatten, tree_max_abs_diff, tree_unflatten
from tests.helpers import lm_batch


def head_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 37, 16, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(16, 53, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, 53, (2, 37), generator=g)
    labels[0, 3] = -100  # ignored, as by F.cross_entropy
    mask = (torch.rand(2, 37, generator=g) > 0.3).float()
    return hidden, weight, labels, mask


@pytest.mark.parametrize("chunk", [1, 10, 37, 74, 1000])
@pytest.mark.parametrize("masked", [True, False])
def test_chunked_head_loss_equals_the_plain_head_in_float64(chunk, masked):
    """Value, token count and both gradients (with a non-unit incoming gradient), any chunking."""
    hidden, weight, labels, mask = head_inputs(torch.float64)
    mask = mask if masked else None
    reference, reference_count = masked_cross_entropy(hidden @ weight, labels, mask)
    reference_grads = torch.autograd.grad(reference * 0.7, (hidden, weight))
    loss, count = chunked_output_layer_loss(hidden, weight, labels, mask, chunk)
    grads = torch.autograd.grad(loss * 0.7, (hidden, weight))
    assert loss.dtype == torch.float64
    assert float(count) == float(reference_count)
    assert abs(float(loss.detach()) - float(reference.detach())) < 1e-10
    for got, want in zip(grads, reference_grads):
        assert float((got - want).abs().max()) < 1e-12


def test_chunked_head_loss_in_bf16_matches_the_plain_head():
    hidden, weight, labels, mask = (x.detach() for x in head_inputs(torch.float32))
    hidden, weight = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    reference, _ = masked_cross_entropy(hidden @ weight, labels, mask)
    reference_grads = torch.autograd.grad(reference, (hidden, weight))
    loss, _ = chunked_output_layer_loss(hidden, weight, labels, mask, 16)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-3)
    for got, want in zip(grads, reference_grads):
        assert got.dtype == torch.bfloat16
        assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.float().abs().max())


def test_without_gradients_only_the_loss_is_computed():
    hidden, weight, labels, mask = (x.detach() for x in head_inputs(torch.float64))
    reference, _ = masked_cross_entropy(hidden @ weight, labels, mask)
    with torch.no_grad():
        loss, _ = chunked_output_layer_loss(hidden, weight, labels, mask, 10)
    assert abs(float(loss) - float(reference)) < 1e-10


def test_bad_chunk_is_refused():
    hidden, weight, labels, mask = head_inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk must be a positive"):
        chunked_output_layer_loss(hidden, weight, labels, mask, 0)
    with pytest.raises(ConfigError, match="model.cross_entropy_chunk_tokens must be >= 0"):
        dataclasses.replace(model_preset("tiny"), cross_entropy_chunk_tokens=-1)


@pytest.mark.parametrize("tie", [True, False])
def test_lm_losses_with_chunks_equal_the_plain_head(tie):
    """Through the model (tied or untied head, with MTP depths), eager."""
    cfg = dataclasses.replace(model_preset("tiny"), tie_embeddings=tie, mtp_num_layers=1, cross_entropy_chunk_tokens=0)
    chunked = dataclasses.replace(cfg, cross_entropy_chunk_tokens=7)
    params = model.init(cfg, seed=0)
    batch = {k: v[0] for k, v in lm_batch(cfg.vocab_size, microbatches=1, batch=2, seq=16).items()}
    scale = torch.tensor(1.0)
    plain, plain_grads = _loss_and_grads(params, batch, cfg, scale)
    out, grads = _loss_and_grads(params, batch, chunked, scale)
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.loss_sum.detach()), rel=1e-6)
    assert torch.allclose(out.mtp_loss_sums.detach(), plain.mtp_loss_sums.detach(), rtol=1e-6)
    assert tree_max_abs_diff(grads, plain_grads) < 1e-5  # fp32 sums of 32 token gradients


def _loss_and_grads(params, batch, cfg, scale):
    leaves, spec = tree_flatten(params)
    leaves = [p.detach().requires_grad_(True) for p in leaves]
    out = lm_loss(tree_unflatten(leaves, spec), batch, cfg, None, scale)
    return out, tree_unflatten(list(torch.autograd.grad(out.loss_sum, leaves)), spec)


def test_compiled_step_with_several_chunks_equals_the_plain_head():
    """The compiled step (one graph) with 3 chunks per microbatch trains like the plain head."""
    base = dataclasses.replace(model_preset("tiny"), cross_entropy_chunk_tokens=0)
    results = []
    for cfg in (base, dataclasses.replace(base, cross_entropy_chunk_tokens=11)):
        tx = adamw(1e-3, weight_decay=0.1)
        step = make_train_step(cfg, tx)
        state = TrainState.create(model.init(cfg, seed=0), tx)
        batch = lm_batch(cfg.vocab_size, microbatches=2, batch=2, seq=16)
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results.append((losses, state.params))
    (plain_losses, plain_params), (losses, params) = results
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert tree_max_abs_diff(params, plain_params) < 1e-5


@pytest.mark.parametrize("hint", [0.7, 1e-3, 250.0])
def test_any_grad_hint_gives_the_same_gradients(hint):
    """The hint only sets the range the gradients are computed in (fp16 loss scaling)."""
    hidden, weight, labels, mask = head_inputs(torch.float64)
    reference, _ = masked_cross_entropy(hidden @ weight, labels, mask)
    reference_grads = torch.autograd.grad(reference * 0.7, (hidden, weight))
    loss, _ = chunked_output_layer_loss(hidden, weight, labels, mask, 10, grad_hint=torch.tensor(hint))
    for got, want in zip(torch.autograd.grad(loss * 0.7, (hidden, weight)), reference_grads):
        assert float((got - want).abs().max()) < 1e-12
