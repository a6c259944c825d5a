"""An older torch refuses what it cannot compile, in one line that names the torch that can; a
newer one refuses nothing (lmfunc.train.torch_support). Runs on every torch of the compat tier."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmfunc.compiler import torch_compat
from lmfunc.config import ModelConfig
from lmfunc.config.model import ConfigError
from lmfunc.train.torch_support import compile_refusal, refuse_what_this_torch_cannot

DENSE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16)
DROPLESS = dataclasses.replace(DENSE, num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)


@pytest.mark.parametrize("model, world_size", [(DENSE, 2), (DROPLESS, 1)])
def test_a_compile_this_torch_cannot_do_is_refused_in_one_line_before_2_13(model, world_size):
    refusal = compile_refusal(model, world_size, compile=True)
    if torch_compat.torch_at_least(2, 13):
        assert refusal is None
        refuse_what_this_torch_cannot(model, world_size, compile=True)
        return
    assert refusal is not None and "\n" not in refusal
    assert f"needs torch >= 2.13; this is torch {torch.__version__}" in refusal and "--run.no-compile" in refusal
    with pytest.raises(ConfigError, match="needs torch >= 2.13"):
        refuse_what_this_torch_cannot(model, world_size, compile=True)


def test_eager_runs_and_one_process_dense_or_capacity_compiles_are_never_refused():
    capacity = dataclasses.replace(DROPLESS, moe_expert_capacity_factor=1.5)
    assert compile_refusal(DENSE, 4, compile=False) is None
    assert compile_refusal(DROPLESS, 1, compile=False) is None
    assert compile_refusal(DENSE, 1, compile=True) is None
    assert compile_refusal(capacity, 1, compile=True) is None
