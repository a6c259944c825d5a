"""``model.scan_layers``: the blocks stacked ``[L, ...]`` and run by torch's ``scan`` give the
unrolled model's numbers, and the compiled graph no longer grows with the depth."""

import dataclasses
import os

import pytest
import torch
import torch.fx

from lmfunc import model
from lmfunc.checkpoint.hf import load_hf, save_hf, to_hf_state_dict
from lmfunc.compiler import compile_step
from lmfunc.config import ModelConfig
from lmfunc.config.train import DataConfig, TrainConfig
from lmfunc.config.model import ConfigError
from lmfunc.generate import generate
from lmfunc.grad import value_and_grad
from lmfunc.loss.next_token import lm_loss
from lmfunc.model.gpt import layer_params, stack_layers, unstack_layers
from lmfunc.train.make_optimizer import decays
from lmfunc.train.resume import check_model_matches
from lmfunc.tree import flatten_with_paths, tree_leaves

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=4, max_position_embeddings=16)


def scanned(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, scan_layers=True)


def batch(cfg: ModelConfig = CFG) -> dict:
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens, "labels": tokens.roll(-1, dims=-1)}


def loss_fn(cfg: ModelConfig):
    seed, data = torch.tensor(5), batch(cfg)

    def loss(params):
        out = lm_loss(params, data, cfg, dropout_seed=seed)
        return out.loss_sum / out.num_tokens

    return loss


def max_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def test_stacked_parameters_are_the_unrolled_ones_stacked():
    flat, stacked = model.init(CFG, seed=3), model.init(scanned(CFG), seed=3)
    assert stacked["layers"]["attn"]["wq"].shape == (3, 32, 32)
    assert model.param_axes(scanned(CFG))["layers"]["mlp"]["w_out"] == ("layers", "mlp", "embed")
    assert max_difference(stack_layers(flat), stacked) == 0.0
    assert max_difference(unstack_layers(stacked, 3), flat) == 0.0
    assert max_difference(layer_params(stacked, scanned(CFG), 1), flat["layers"]["1"]) == 0.0


@pytest.mark.parametrize("extra", [{"hidden_dropout": 0.2, "attention_dropout": 0.2},
                                   {"recompute_granularity": "selective"}])
def test_eager_scan_gives_the_unrolled_loss_and_gradients_exactly(extra):
    """Eagerly, scan runs the same blocks in the same order: with dropout each block's streams
    come from its index as a tensor, and the masks are the unrolled model's."""
    cfg = dataclasses.replace(CFG, **extra)
    loss, grads = value_and_grad(loss_fn(cfg))(model.init(cfg, seed=0))
    scan_loss, scan_grads = value_and_grad(loss_fn(scanned(cfg)))(model.init(scanned(cfg), seed=0))
    assert float(scan_loss) == float(loss)
    assert max_difference(scan_grads, stack_layers(grads)) == 0.0


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_scan_step_gradients_equal_the_compiled_unrolled_step(backend):
    """The gradients through the traced ``autograd.grad`` of the one compiled step, scan against
    unrolled (fp32, with dropout and full recompute, 2 layers: the unrolled graph's compile grows
    with each): equal to 1e-6. ``aot_eager`` checks what Dynamo and AOTAutograd make of scan's
    gradient; ``inductor`` adds the generated code."""
    cfg = dataclasses.replace(CFG, num_layers=2, hidden_dropout=0.1, attention_dropout=0.1, recompute_granularity="full")
    loss, grads = compile_step(value_and_grad(loss_fn(cfg)), backend=backend)(model.init(cfg, seed=0))
    scan_loss, scan_grads = compile_step(value_and_grad(loss_fn(scanned(cfg))), backend=backend)(
        model.init(scanned(cfg), seed=0))
    assert float(scan_loss) == pytest.approx(float(loss), rel=1e-6)
    assert max_difference(scan_grads, stack_layers(grads)) < 1e-6
    assert max(float(g.abs().max()) for g in tree_leaves(grads)) > 1e-3


def graph_nodes(cfg: ModelConfig) -> int:
    """FX nodes Dynamo hands the backend for the compiled loss and gradient (subgraphs included)."""
    sizes = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs):
        sizes.append(sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
        return gm

    compile_step(value_and_grad(loss_fn(cfg)), backend=counting_backend)(model.init(cfg, seed=0))
    assert len(sizes) == 1
    return sizes[0]


def test_the_scanned_graph_does_not_grow_with_depth():
    """What makes compile time depth-independent: with scan_layers the graph holds one block
    whatever the depth; unrolled, every block adds its nodes."""
    shallow, deep = CFG, dataclasses.replace(CFG, num_layers=6)
    assert graph_nodes(scanned(deep)) == graph_nodes(scanned(shallow))
    assert graph_nodes(deep) > graph_nodes(shallow) + 100


def test_weight_decay_skips_stacked_norms():
    cfg = TrainConfig(model=scanned(CFG))
    params = model.init(cfg.model, seed=0)
    decayed = {name for name, leaf in flatten_with_paths(params) if decays(cfg, name, leaf)}
    assert "layers.attn.wq" in decayed and "layers.mlp.w_out" in decayed
    assert "layers.attn_norm.scale" not in decayed and "final_norm.scale" not in decayed


def test_generation_and_hf_export_see_the_same_model(tmp_path):
    flat, stacked = model.init(CFG, seed=1), model.init(scanned(CFG), seed=1)
    prompt = [1, 2, 3]
    assert torch.equal(generate(stacked, scanned(CFG), prompt, 6, temperature=0.0),
                       generate(flat, CFG, prompt, 6, temperature=0.0))
    assert max_difference(to_hf_state_dict(stacked, scanned(CFG)), to_hf_state_dict(flat, CFG)) == 0.0
    save_hf(stacked, scanned(CFG), str(tmp_path / "hf"))
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")
    assert max_difference(load_hf(str(tmp_path / "hf"), scanned(CFG)), stacked) == 0.0


def test_scan_layers_is_refused_on_several_processes():
    cfg = TrainConfig(model=scanned(CFG), data=DataConfig(seq_length=16))
    cfg.validate(1)
    with pytest.raises(ConfigError, match="model.scan_layers runs on one process only"):
        cfg.validate(2)


def test_resuming_across_the_two_layouts_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.scan_layers: checkpoint False, this run True"):
        check_model_matches(CFG, scanned(CFG), "runs/x/checkpoints/iter_0000010")
    check_model_matches(scanned(CFG), scanned(CFG), "runs/x/checkpoints/iter_0000010")


SCANNED_STEP = """
import json, os, torch
from torch._dynamo.utils import counters
from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import adamw
from lmfunc.train import TrainState
from lmfunc.train.step import make_train_step
factor = float(os.environ["SILU_FACTOR"])
silu = torch.nn.functional.silu
torch.nn.functional.silu = lambda x, inplace=False: silu(x) * factor
cfg = model_preset("tiny", scan_layers=True)
tx = adamw(1e-3)
state = TrainState.create(model.init(cfg, seed=0), tx)
tokens = torch.randint(0, cfg.vocab_size, (1, 2, 16), generator=torch.Generator().manual_seed(0))
state, metrics = make_train_step(cfg, tx, compile=True, donate_state=True)(state, {"tokens": tokens, "labels": tokens})
print(json.dumps({"loss": float(metrics["loss"]), **counters["inductor"], **counters["aot_autograd"]}))
"""


@pytest.mark.slow
def test_a_restarted_scan_step_loads_from_the_compile_caches_and_a_changed_body_misses(tmp_path):
    """torch's ``scan`` is opted into the FX graph and AOTAutograd caches: a restarted process loads
    the scanned step from them, and a process whose scanned block computes something else (the
    activation inside every block scaled) misses and gets its own loss, so the block's body is
    part of the cache key."""
    from tests.test_compiling import _run_script

    first = _run_script(SCANNED_STEP, tmp_path, {"SILU_FACTOR": "1.0"})
    changed = _run_script(SCANNED_STEP, tmp_path, {"SILU_FACTOR": "1.5"})
    again = _run_script(SCANNED_STEP, tmp_path, {"SILU_FACTOR": "1.0"})
    assert first.get("fxgraph_cache_miss") == 1 and first.get("autograd_cache_saved") == 1
    assert "fxgraph_cache_bypass" not in first and "autograd_cache_bypass" not in first
    assert changed.get("autograd_cache_miss") == 1 and "autograd_cache_hit" not in changed
    assert changed["loss"] != first["loss"]
    assert again.get("fxgraph_cache_hit") == 1 and again.get("autograd_cache_hit") == 1
    assert again["loss"] == first["loss"]
