"""``gradient_underflow``: the fraction of gradient elements that a low-precision backward pass
rounds to zero, per parameter group."""

import pytest
import torch

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.train.grad_underflow import gradient_underflow, parameter_group
from tests.helpers import lm_batch

TINY = model_preset("tiny")


@pytest.fixture(scope="module")
def params_and_micro():
    params = model.init(TINY, seed=0)
    batch = lm_batch(TINY.vocab_size, 1, 4, 16)
    return params, {k: v[0] for k, v in batch.items()}


def test_parameter_groups_follow_the_paths():
    assert parameter_group("embed.tokens") == "embedding"
    assert parameter_group("layers.3.attn.wq") == "attention"
    assert parameter_group("layers.0.mlp.w_gate") == "mlp"
    assert parameter_group("layers.0.attn_norm.scale") == "norms"
    assert parameter_group("final_norm.scale") == "norms"
    assert parameter_group("output") == "output"
    assert parameter_group("mtp.0.layer.attn.wq") == "mtp"


def test_fp32_never_underflows_against_itself(params_and_micro):
    params, micro = params_and_micro
    fractions = gradient_underflow(params, micro, TINY, torch.float32, scale=1.0)
    assert fractions["all"] == 0.0 and fractions["overflow"] == 0.0


def test_fp16_underflow_falls_as_the_scale_rises_and_overflows_when_too_large(params_and_micro):
    params, micro = params_and_micro
    fractions = {s: gradient_underflow(params, micro, TINY, torch.float16, scale=s) for s in (2.0**-16, 1.0, 2.0**12)}
    # A scale of 2^-16 pushes most gradients below fp16's smallest subnormal (2^-24).
    assert fractions[2.0**-16]["all"] > 0.5
    assert fractions[2.0**-16]["all"] > fractions[1.0]["all"] >= fractions[2.0**12]["all"]
    assert fractions[2.0**12]["all"] < 1e-3 and fractions[2.0**12]["overflow"] == 0.0
    assert {"embedding", "attention", "mlp", "norms"} <= set(fractions[1.0])
    # Past fp16's range (65504) the scaled gradients are infinite: that step would be skipped.
    assert gradient_underflow(params, micro, TINY, torch.float16, scale=2.0**40)["overflow"] > 0.0


def test_bf16_shares_fp32s_range_so_nothing_underflows_at_scale_one(params_and_micro):
    params, micro = params_and_micro
    assert gradient_underflow(params, micro, TINY, torch.bfloat16)["all"] < 1e-4
