"""The minimum-cut choice of the forward values the one compiled step keeps for its backward."""

import dataclasses
import functools

import pytest
import torch
import torch._inductor.config
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import adamw
from lmfunc.compiler import compiling, recompute_pass as remat
from lmfunc.train import TrainState, make_train_step
from lmfunc.train import step as step_module
from lmfunc.compiler.saved_values import choose_recompute, is_backward
from lmfunc.tree import tree_max_abs_diff
from tests.helpers import lm_batch

aten = torch.ops.aten
N, D, F = 64, 16, 48  # tokens, model width, MLP width


def _node(graph: fx.Graph, target, args, shape, backward=False) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = torch.empty(shape)
    node.meta["autograd_backward"] = backward
    return node


def silu_mlp_graph():
    """Forward ``a = x @ w; s = sigmoid(a); c = a * s; y = c @ w2`` and the backward ops that read
    ``c`` (the w2 gradient), ``s`` and ``a`` (the SiLU derivative). Returns the graph and its nodes."""
    graph = fx.Graph()
    inputs = {}
    for name, shape in (("x", (N, D)), ("w", (D, F)), ("w2", (F, D)), ("grad_y", (N, D))):
        inputs[name] = graph.placeholder(name)
        inputs[name].meta["val"] = torch.empty(shape)
    a = _node(graph, aten.mm.default, (inputs["x"], inputs["w"]), (N, F))
    s = _node(graph, aten.sigmoid.default, (a,), (N, F))
    c = _node(graph, aten.mul.Tensor, (a, s), (N, F))
    y = _node(graph, aten.mm.default, (c, inputs["w2"]), (N, D))
    c_t = _node(graph, aten.permute.default, (c, [1, 0]), (F, N), backward=True)
    grad_w2 = _node(graph, aten.mm.default, (c_t, inputs["grad_y"]), (F, D), backward=True)
    w2_t = _node(graph, aten.permute.default, (inputs["w2"], [1, 0]), (D, F), backward=True)
    grad_c = _node(graph, aten.mm.default, (inputs["grad_y"], w2_t), (N, F), backward=True)
    grad_a = _node(graph, aten.mul.Tensor, (grad_c, s), (N, F), backward=True)
    grad_a = _node(graph, aten.mul.Tensor, (grad_a, a), (N, F), backward=True)
    graph.output((y, grad_w2, grad_a))
    return graph, {"a": a, "s": s, "c": c, "y": y}


def test_min_cut_keeps_the_matmul_output_and_recomputes_the_pointwise_ops():
    """Storing a, s and c costs 3 N F; storing a alone (s and c recomputed from it) costs N F."""
    graph, nodes = silu_mlp_graph()
    assert choose_recompute(graph) == {nodes["s"], nodes["c"]}


def test_min_cut_never_recomputes_matmuls_or_random_ops_and_honours_tags():
    graph, nodes = silu_mlp_graph()
    nodes["s"].meta["recompute"] = CheckpointPolicy.MUST_SAVE
    assert choose_recompute(graph) == {nodes["c"]}

    graph, nodes = silu_mlp_graph()
    nodes["a"].meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE  # a checkpointed region
    assert choose_recompute(graph) == {nodes["a"], nodes["s"], nodes["c"]}

    graph, nodes = silu_mlp_graph()
    nodes["s"].target = aten.bernoulli.p  # an RNG draw: recomputing it would change the gradient
    assert choose_recompute(graph) == {nodes["c"]}


def test_a_scalar_read_back_from_a_tensor_does_not_stop_the_cut():
    """Expert parallelism reads its all-to-all's split sizes back from a tensor (unbacked SymInts)
    and its backward reuses them. Such a scalar is free to keep: the cut must still recompute the
    pointwise ops (before, an unstorable scalar made the cut unbounded and everything was kept)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    graph, nodes = silu_mlp_graph()
    with graph.inserting_after(nodes["y"]):
        size = graph.call_function(aten._local_scalar_dense.default, (nodes["y"],))
    size.meta["val"] = ShapeEnv().create_unbacked_symint()
    size.meta["autograd_backward"] = False
    grad_a = next(node for node in reversed(graph.nodes) if node.op == "output").args[0][2]
    with graph.inserting_after(grad_a):
        scaled = _node(graph, aten.mul.Tensor, (grad_a, size), (N, F), backward=True)
    output = next(node for node in graph.nodes if node.op == "output")
    output.args = ((output.args[0][0], output.args[0][1], scaled),)
    assert choose_recompute(graph) == {nodes["s"], nodes["c"]}


def test_no_backward_means_nothing_to_recompute():
    graph, _ = silu_mlp_graph()
    for node in graph.nodes:
        node.meta["autograd_backward"] = False
    assert choose_recompute(graph) == set()


def _kept_bytes(graph: fx.Graph) -> int:
    """Bytes of the forward buffers a backward op reads (a view counts as its base)."""

    def base(node: fx.Node) -> fx.Node:
        while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
            node = node.args[0]
        return node

    kept = {
        base(arg) for node in graph.nodes if is_backward(node) for arg in node.all_input_nodes if not is_backward(arg)
    }
    return sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n in kept if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
    )


def run_compiled(monkeypatch, cfg, choose_saved: bool):
    kept = []

    def measuring(graph, *args):
        remat_original(graph, *args)
        kept.append(_kept_bytes(graph))

    remat_original = remat.rematerialize
    monkeypatch.setattr(remat, "rematerialize", measuring)
    monkeypatch.setattr(step_module, "compile_step", functools.partial(compiling.compile_step, choose_saved=choose_saved))
    tx = adamw(1e-3, weight_decay=0.1)
    train_step = make_train_step(cfg, tx)
    state = TrainState.create(model.init(cfg, seed=0), tx)
    batch = lm_batch(cfg.vocab_size, microbatches=2, batch=2, seq=32)
    losses = []
    with torch._inductor.config.patch(fx_graph_cache=False):
        for _ in range(2):
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    monkeypatch.undo()
    return state, losses, kept


@pytest.mark.slow
def test_compiled_step_keeps_fewer_bytes_with_the_same_result(monkeypatch):
    """On the tiny model (SwiGLU, RMSNorm, RoPE, 2 microbatches) the chosen recompute keeps at
    most 80% of the bytes the plain graph keeps for its backward, and training is unchanged."""
    cfg = dataclasses.replace(model_preset("tiny"), vocab_size=512)
    plain_state, plain_losses, plain_kept = run_compiled(monkeypatch, cfg, choose_saved=False)
    state, losses, kept = run_compiled(monkeypatch, cfg, choose_saved=True)
    assert len(kept) == len(plain_kept) == 1
    assert kept[0] <= 0.8 * plain_kept[0], (kept, plain_kept)
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    assert tree_max_abs_diff(state.params, plain_state.params) < 1e-5
