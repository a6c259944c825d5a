import dataclasses

import pytest
import torch

from lmfunc import model
from lmfunc.compiler import compile_step
from lmfunc.config import model_preset
from lmfunc.loss import attach_aux_loss, masked_cross_entropy
from lmfunc.model import mtp
from lmfunc.optim import GradientTransformation, adamw
from lmfunc.precision import LossScaleConfig
from lmfunc.train import TrainState, make_train_step
from lmfunc.tree import flatten_with_paths, tree_flatten, tree_max_abs_diff, tree_unflatten, tree_zeros_like
from tests.helpers import lm_batch

MTP = dataclasses.replace(model_preset("tiny"), mtp_num_layers=2, mtp_loss_scaling_factor=0.3)


@pytest.mark.parametrize(
    "depends_on_xy, scale, expected_aux_grad, expected_dx, expected_dy",
    [(False, 1.0, 1.0, 3.0, 2.0), (False, 0.3, 0.3, 3.0, 2.0), (True, 1.0, 1.0, 6.0, 5.0), (True, 0.6, 0.6, 4.8, 3.8)],
)
def test_attach_aux_loss_reproduces_megatrons_four_scenarios(depends_on_xy, scale, expected_aux_grad, expected_dx, expected_dy):
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(3.0, requires_grad=True)
    output = x * y
    aux = 3 * (x + y) if depends_on_xy else torch.tensor(5.0, requires_grad=True)
    aux.retain_grad()
    result = attach_aux_loss(output, aux, scale)
    assert float(result.detach()) == 6.0
    result.backward()
    assert float(aux.grad) == pytest.approx(expected_aux_grad)
    assert float(x.grad) == pytest.approx(expected_dx) and float(y.grad) == pytest.approx(expected_dy)


def test_attach_aux_loss_compiles_with_autograd_grad():
    def grads(x, y, scale):
        return torch.autograd.grad(attach_aux_loss(x * y, 3 * (x + y), scale), [x, y])

    x, y = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    dx, dy = compile_step(grads, backend="aot_eager")(x, y, torch.tensor(0.6))
    assert float(dx) == pytest.approx(4.8) and float(dy) == pytest.approx(3.8)


def test_roll_left_shifts_and_zero_fills():
    assert mtp.roll_left(torch.tensor([[1, 2, 3], [4, 5, 6]])).tolist() == [[2, 3, 0], [5, 6, 0]]


def test_mtp_parameters_have_megatrons_layout():
    names = dict(flatten_with_paths(model.init(MTP, seed=0)))
    h = MTP.hidden_size
    assert names["mtp.1.eh_proj"].shape == (2 * h, h)
    for part in ("enorm.scale", "hnorm.scale", "final_norm.scale", "layer.attn.wq", "layer.mlp.w_out"):
        assert f"mtp.0.{part}" in names and f"mtp.1.{part}" in names
    assert "mtp.2.eh_proj" not in names


def direct_objective(params, batch, cfg):
    """``main_loss + (factor / D) * sum_k mtp_loss_k`` over the whole batch, each a per-token mean,
    written out without ``attach_aux_loss``."""
    tokens, labels = batch["tokens"].flatten(0, 1), batch["labels"].flatten(0, 1)
    hidden = model.forward(params, tokens, cfg)
    main_sum, main_count = masked_cross_entropy(model.logits(params, hidden, cfg), labels)
    total = main_sum / main_count
    depth_labels, depth_mask = labels, torch.ones(labels.shape)
    per_depth = []
    for h in mtp.forward(params, hidden, tokens, cfg)[0]:
        depth_labels, depth_mask = mtp.roll_left(depth_labels), mtp.roll_left(depth_mask)
        depth_sum, depth_count = masked_cross_entropy(model.logits(params, h, cfg), depth_labels, depth_mask)
        per_depth.append(depth_sum / depth_count)
    return total + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * sum(per_depth), per_depth


def record_grads() -> GradientTransformation:
    return GradientTransformation(init=tree_zeros_like, update=lambda updates, state, params: (tree_zeros_like(updates), updates))


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("per_token", [True, False])
def test_step_gradients_equal_the_direct_mtp_objective(microbatches, per_token):
    batch = lm_batch(MTP.vocab_size, microbatches=microbatches, batch=8 // microbatches, seq=16)
    del batch["loss_mask"]
    params = model.init(MTP, seed=0)
    flat, spec = tree_flatten(params)
    inputs = [leaf.detach().requires_grad_(True) for leaf in flat]
    objective, per_depth = direct_objective(tree_unflatten(inputs, spec), batch, MTP)
    names = [name for name, _ in flatten_with_paths(params)]
    direct = dict(zip(names, torch.autograd.grad(objective, inputs)))

    step = make_train_step(MTP, record_grads(), clip_grad=0.0, calculate_per_token_loss=per_token, compile=False)
    state, metrics = step(TrainState.create(params, record_grads()), batch)
    stepped = dict(flatten_with_paths(state.opt_state))
    assert set(stepped) == set(direct)
    worst = max(float((stepped[name] - direct[name]).abs().max()) for name in direct)
    assert worst < 1e-6, worst
    assert float((stepped["mtp.1.eh_proj"]).abs().max()) > 0, "the deepest MTP layer must get gradients"
    for k, value in enumerate(per_depth, start=1):
        torch.testing.assert_close(metrics[f"mtp_{k}_loss"], value.detach(), rtol=1e-6, atol=1e-6)


def test_a_zero_mtp_loss_factor_gives_the_direct_gradients_with_the_chunked_head():
    """mtp_loss_scaling_factor 0 tells the MTP depths' chunked heads their gradient is 0; that hint
    must not divide their gradients (0 / 0 gave NaN): every gradient is the direct objective's (the
    MTP layers' are 0)."""
    cfg = dataclasses.replace(MTP, mtp_loss_scaling_factor=0.0)
    assert cfg.cross_entropy_chunk_tokens > 0
    batch = lm_batch(cfg.vocab_size, microbatches=1, batch=4, seq=16)
    del batch["loss_mask"]
    params = model.init(cfg, seed=0)
    flat, spec = tree_flatten(params)
    inputs = [leaf.detach().requires_grad_(True) for leaf in flat]
    objective, _ = direct_objective(tree_unflatten(inputs, spec), batch, cfg)
    direct = dict(zip([name for name, _ in flatten_with_paths(params)],
                      torch.autograd.grad(objective, inputs, allow_unused=True, materialize_grads=True)))
    step = make_train_step(cfg, record_grads(), clip_grad=0.0, compile=False)
    state, _ = step(TrainState.create(params, record_grads()), batch)
    stepped = dict(flatten_with_paths(state.opt_state))
    assert all(bool(torch.isfinite(g).all()) for g in stepped.values())
    worst = max(float((stepped[name] - direct[name]).abs().max()) for name in direct)
    assert worst < 1e-6, worst
    assert float(stepped["mtp.0.eh_proj"].abs().max()) == 0.0


@pytest.mark.parametrize("per_token", [True, False])
def test_chunked_head_gradient_hints_are_exact_for_every_depth(monkeypatch, per_token):
    """Each chunked head (main and every MTP depth) is told the gradient it will receive, so its
    backward factor ``incoming / hint`` is 1 (the fp16 range argument of ``output_layer_loss``)."""
    from lmfunc.loss import chunked_output

    factors = []
    original = chunked_output._ChunkedOutputLayerLoss.backward

    def recording_backward(ctx, grad_loss, *rest):
        factors.append(float(grad_loss / ctx.saved_tensors[2]))
        return original(ctx, grad_loss, *rest)

    monkeypatch.setattr(chunked_output._ChunkedOutputLayerLoss, "backward", staticmethod(recording_backward))
    batch = lm_batch(MTP.vocab_size, microbatches=2, batch=2, seq=16)
    tx = record_grads()
    step = make_train_step(MTP, tx, clip_grad=0.0, calculate_per_token_loss=per_token, compile=False)
    step(TrainState.create(model.init(MTP, seed=0), tx), batch)
    assert len(factors) == 2 * (1 + MTP.mtp_num_layers)
    assert max(abs(f - 1.0) for f in factors) < 1e-6, factors


def test_mtp_leaves_the_reported_loss_and_eval_alone():
    base = dataclasses.replace(MTP, mtp_num_layers=0)
    batch = lm_batch(MTP.vocab_size, microbatches=2, batch=2, seq=16)
    params = model.init(MTP, seed=0)
    base_params = {k: v for k, v in params.items() if k != "mtp"}
    tx = adamw(1e-3)
    _, with_mtp = make_train_step(MTP, tx, compile=False)(TrainState.create(params, tx), batch)
    _, without = make_train_step(base, tx, compile=False)(TrainState.create(base_params, tx), batch)
    torch.testing.assert_close(with_mtp["loss"], without["loss"])
    assert "mtp_2_loss" in with_mtp and "mtp_1_loss" not in without


def test_compiled_step_with_mtp_and_loss_scaling_is_one_graph_and_matches_eager():
    scaler = LossScaleConfig(initial_scale=2.0**10)
    tx = adamw(1e-3)
    eager = make_train_step(MTP, tx, loss_scale=scaler, compile=False)
    compiled = make_train_step(MTP, tx, loss_scale=scaler)
    eager_state = compiled_state = TrainState.create(model.init(MTP, seed=0), tx, loss_scale=scaler)
    torch._dynamo.utils.counters.clear()
    for i in range(2):
        batch = lm_batch(MTP.vocab_size, microbatches=2, batch=2, seq=16, seed=i)
        eager_state, eager_metrics = eager(eager_state, batch)
        compiled_state, compiled_metrics = compiled(compiled_state, batch)
        for key in ("loss", "grad_norm", "mtp_1_loss", "mtp_2_loss", "loss_scale"):
            torch.testing.assert_close(compiled_metrics[key], eager_metrics[key], rtol=1e-5, atol=1e-5)
    assert tree_max_abs_diff(compiled_state.params, eager_state.params) < 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
