import dataclasses

import pytest
import torch
import torch._inductor.config

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import GradientTransformation
from lmfunc.compiler import recompute_pass as remat
from lmfunc.train import TrainState, make_train_step
from lmfunc.tree import tree_max_abs_diff, tree_zeros_like
from tests.helpers import lm_batch

BASE = dataclasses.replace(model_preset("tiny"), hidden_dropout=0.1, attention_dropout=0.1, mtp_num_layers=1)


def record_grads() -> GradientTransformation:
    return GradientTransformation(init=tree_zeros_like, update=lambda updates, state, params: (tree_zeros_like(updates), updates))


def grads_of(cfg, compile: bool = False):
    step = make_train_step(cfg, record_grads(), clip_grad=0.0, compile=compile)
    batch = lm_batch(cfg.vocab_size, microbatches=4, batch=2, seq=16)
    state, metrics = step(TrainState.create(model.init(cfg, seed=0), record_grads(), seed=3), batch)
    return state.opt_state, metrics["loss"]


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_gives_the_same_loss_and_grads(granularity):
    """Eager: torch.utils.checkpoint re-runs the blocks (dropout included: it is seeded, so exact)."""
    reference, reference_loss = grads_of(BASE)
    grads, loss = grads_of(dataclasses.replace(BASE, recompute_granularity=granularity))
    assert float(loss) == float(reference_loss)
    assert tree_max_abs_diff(grads, reference) < 1e-6


@pytest.mark.slow  # about a minute of compiling
def test_compiled_full_recompute_rematerialises_each_microbatch(monkeypatch):
    """Compiled: the remat pass copies the tagged forward ops into every microbatch's backward
    (more matmuls in the graph), and the gradients still equal the eager ones without recompute."""
    seen = []

    def counting(graph, *args):
        matmuls = lambda: sum(node.target is torch.ops.aten.mm.default for node in graph.nodes)  # noqa: E731
        before = matmuls()
        remat_original(graph, *args)
        seen.append((before, matmuls()))

    remat_original = remat.rematerialize
    monkeypatch.setattr(remat, "rematerialize", counting)
    cfg = dataclasses.replace(BASE, hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity="full")
    with torch._inductor.config.patch(fx_graph_cache=False):
        grads, _ = grads_of(cfg, compile=True)
    reference, _ = grads_of(dataclasses.replace(cfg, recompute_granularity="none"))
    assert tree_max_abs_diff(grads, reference) < 1e-5
    assert len(seen) == 1
    before, after = seen[0]
    # Per microbatch, every block's (and the MTP layer's) forward matmuls run again in its backward.
    layers = cfg.num_layers + cfg.mtp_num_layers
    assert after - before >= 4 * layers * 5, seen


def test_recompute_rejects_global_rng_inside_a_region():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    drop = graph.call_function(torch.ops.aten.native_dropout.default, (x, 0.5, True))
    drop.meta["recompute"] = torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    graph.output(drop)
    with pytest.raises(RuntimeError, match="global RNG"):
        remat.check_randomness(list(graph.nodes))
