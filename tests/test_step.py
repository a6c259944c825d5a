import dataclasses
import json
import os
import sysconfig

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.config
from torch._inductor import metrics as inductor_metrics

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.optim import GradientTransformation, adamw, warmup_decay_schedule
from lmfunc.train import TrainState, make_eval_step, make_train_step
from lmfunc.tree import tree_leaves, tree_map, tree_max_abs_diff, tree_zeros_like
from tests.helpers import lm_batch, traced_instructions

TINY = model_preset("tiny")


def record_grads() -> GradientTransformation:
    """A 'transformation' that stores the gradients in its state and leaves params unchanged."""
    return GradientTransformation(
        init=tree_zeros_like, update=lambda updates, state, params: (tree_zeros_like(updates), updates)
    )


def test_microbatches_give_the_same_loss_and_grads_as_one_batch(tiny_state):
    batch = lm_batch(TINY.vocab_size, microbatches=4, batch=2, seq=16)
    whole = tree_map(lambda x: x.reshape(1, 8, 16), batch)
    step = make_train_step(TINY, record_grads(), clip_grad=0.0, compile=False)
    state = tiny_state(record_grads())
    split_state, split_metrics = step(state, batch)
    whole_state, whole_metrics = step(state, whole)
    torch.testing.assert_close(split_metrics["loss"], whole_metrics["loss"], rtol=1e-6, atol=1e-6)
    assert float(split_metrics["num_tokens"]) == float(batch["loss_mask"].sum())
    assert tree_max_abs_diff(split_state.opt_state, whole_state.opt_state) < 1e-6
    assert float(split_metrics["grad_norm"]) > 0
    assert int(split_state.consumed_samples) == 8 and int(split_state.step) == 1


def _side_by_side(step_a, step_b, state_a, state_b, keys, tol):
    """Run both steps over the same 3 batches of 3 microbatches (the compiled step orders its sums
    of microbatch gradients between them, ``lmfunc.compiler.accumulation_order``), asserting the metrics in ``keys`` agree to ``tol``;
    returns both final states."""
    for i in range(3):
        batch = lm_batch(TINY.vocab_size, microbatches=3, batch=2, seq=16, seed=i)
        state_a, metrics_a = step_a(state_a, batch)
        state_b, metrics_b = step_b(state_b, batch)
        for key in keys:
            torch.testing.assert_close(metrics_b[key], metrics_a[key], rtol=tol, atol=tol)
    return state_a, state_b


def test_compiled_step_equals_eager_and_is_one_graph(tiny_state):
    schedule = warmup_decay_schedule(1e-2, 1e-3, warmup_steps=1, decay_steps=10)
    tx = adamw(schedule, weight_decay=0.1)
    eager = make_train_step(TINY, tx, lr_schedule=schedule, compile=False)
    compiled = make_train_step(TINY, tx, lr_schedule=schedule)
    state = tiny_state(tx)
    torch._dynamo.utils.counters.clear()
    eager_state, compiled_state = _side_by_side(eager, compiled, state, state, ("loss", "grad_norm", "lr"), 1e-5)
    assert tree_max_abs_diff(compiled_state.params, eager_state.params) < 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "the train step must compile to exactly one graph"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert int(compiled_state.step) == 3


def test_donating_step_updates_the_state_in_place_and_equals_the_plain_step(tiny_state):
    """donate_state=True writes the new params and Adam moments into the input state's tensors
    (one graph, no breaks) and trains exactly as the step that returns new tensors."""
    tx = adamw(1e-2, weight_decay=0.1)
    plain = make_train_step(TINY, tx)
    donating = make_train_step(TINY, tx, donate_state=True)
    first = tiny_state(tx)
    torch._dynamo.utils.counters.clear()
    plain_state, donated_state = _side_by_side(
        plain, donating, tiny_state(tx), first, ("loss", "grad_norm"), 1e-6)
    assert tree_max_abs_diff(donated_state.params, plain_state.params) < 1e-6
    assert tree_max_abs_diff(donated_state.opt_state, plain_state.opt_state) < 1e-6
    donated = tree_leaves((donated_state.params, donated_state.opt_state))
    before = tree_leaves((first.params, first.opt_state))
    assert all((after is old) == (old.dim() > 0) for old, after in zip(before, donated))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the plain step's and the donating one's
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert int(donated_state.step) == 3

    eager_state = tiny_state(tx)
    eager_donated = tiny_state(tx)
    batch = lm_batch(TINY.vocab_size, microbatches=2, batch=2, seq=16)
    eager_state, _ = make_train_step(TINY, tx, compile=False)(eager_state, batch)
    eager_donated, _ = make_train_step(TINY, tx, compile=False, donate_state=True)(eager_donated, batch)
    assert tree_max_abs_diff(eager_donated.params, eager_state.params) == 0.0


def _plain_and_donated(cfg, measure) -> dict:
    """``{donate: measure(step, state)}`` for the compiled plain (False) and donating (True) step,
    each compiled afresh (FX graph cache off) from the same initial state."""
    tx = adamw(1e-2, weight_decay=0.1)
    results = {}
    for donate in (False, True):
        step = make_train_step(cfg, tx, donate_state=donate)
        state = TrainState.create(model.init(cfg, seed=0), tx)
        with torch._inductor.config.patch(fx_graph_cache=False):
            results[donate] = measure(step, state)
    return results


@pytest.mark.slow
def test_donating_step_lowers_to_no_more_inductor_nodes_than_the_plain_step():
    """Writing the new state into the old one must not make Inductor materialise the optimizer's
    intermediate values: each Adam moment's last op reads the old moment first (so it becomes one
    in-place update) and the 0-dim counters are not written into. Before, the donating step
    lowered to 17% more IR nodes on this model (about 2x on others) and recomputed the moments
    inside each parameter update."""
    batch = lm_batch(TINY.vocab_size, microbatches=1, batch=2, seq=16)

    def ir_nodes(step, state) -> int:
        inductor_metrics.reset()
        step(state, batch)
        return inductor_metrics.ir_nodes_pre_fusion

    nodes = _plain_and_donated(TINY, ir_nodes)
    assert nodes[False] > 0
    assert nodes[True] <= 1.05 * nodes[False], nodes


@pytest.mark.slow
def test_donating_step_needs_no_more_memory_than_the_plain_step(tmp_path):
    """Writing into the parameters must not cost Inductor's in-place reuse of the buffers made by ops
    that read them (``lmfunc.compiler.inplace_reuse``). Without it the softmax gradient of each logits
    chunk gets a new buffer next to the chunk's logits, and this donating step peaks 2.6% above the
    plain one (5.55 against 5.41 MB); with it, 1.8% below."""
    cfg = dataclasses.replace(TINY, vocab_size=2048)
    batch = lm_batch(cfg.vocab_size, microbatches=1, batch=4, seq=64)

    def steady_peak_bytes(step, state) -> int:
        """Peak bytes allocated during one call of the compiled step above what was live before it
        (the allocation events of ``torch.profiler``)."""
        state, _ = step(state, batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step(state, batch)
        trace = tmp_path / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e["ts"]):
            live += event["args"]["Bytes"]
            peak = max(peak, live)
        return peak

    peaks = _plain_and_donated(cfg, steady_peak_bytes)
    assert peaks[False] > 0
    assert peaks[True] <= peaks[False], peaks


@dataclasses.dataclass
class _Box:
    """A pytree node type of the user's (registered below)."""

    value: torch.Tensor


torch.utils._pytree.register_dataclass(_Box)


def test_write_into_copies_donated_leaves_of_every_pytree_node_kind():
    """Dicts, lists, tuples, NamedTuples, None, 0-dim counters and a user-registered node type:
    every tensor of rank >= 1 gets the new values in place, everything else is the new leaf."""
    from lmfunc.optim.transforms import ScaleByAdamState
    from lmfunc.train.step import write_into

    def tree(scale: float):
        return {
            "adam": ScaleByAdamState(count=torch.tensor(scale), mu={"w": torch.full((2, 3), scale)},
                                     nu={"w": torch.full((2, 3), 2 * scale)}),
            "chain": (None, [torch.full((4,), scale)]),
            "box": _Box(torch.full((3,), scale)),
        }

    old, new = tree(1.0), tree(5.0)
    merged = write_into(old, new)
    assert merged["adam"].mu["w"] is old["adam"].mu["w"] and float(old["adam"].mu["w"].max()) == 5.0
    assert merged["adam"].nu["w"] is old["adam"].nu["w"] and float(old["adam"].nu["w"].min()) == 10.0
    assert merged["adam"].count is new["adam"].count and float(old["adam"].count) == 1.0
    assert merged["chain"][0] is None and merged["chain"][1][0] is old["chain"][1][0]
    assert type(merged["chain"]) is tuple and type(merged["chain"][1]) is list
    assert merged["box"].value is old["box"].value and float(old["box"].value.sum()) == 15.0
    assert type(merged["adam"]) is ScaleByAdamState and isinstance(merged["box"], _Box)


def test_write_into_refuses_an_update_that_changes_the_state_structure():
    from lmfunc.train.step import write_into

    with pytest.raises(ValueError, match="another structure"):
        write_into(_Box(torch.zeros(2)), (torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ValueError, match=r"another structure than the one it was given \(a NoneType where the state holds a tensor\)"):
        write_into({"b": torch.zeros(2)}, {"b": None})
    old = {"a": torch.zeros(2), "b": torch.zeros(2)}
    for new in ({"a": torch.ones(2)}, {"a": torch.ones(2), "c": torch.ones(2)}, {"a": [torch.ones(2)], "b": torch.ones(2)}):
        with pytest.raises(ValueError, match="another structure"):
            write_into(old, new)
    assert float(old["a"].sum()) == 0.0
    merged = write_into(old, {"b": torch.full((2,), 2.0), "a": torch.ones(2)})  # keys matched by name
    assert list(merged) == ["a", "b"] and merged["a"] is old["a"]
    assert float(old["a"].sum()) == 2.0 and float(old["b"].sum()) == 4.0


def test_donating_step_traces_little_more_bytecode_than_the_plain_step(tiny_state):
    """``write_into`` is one ``tree_map`` over the old and new state, which Dynamo maps natively;
    ``tree_flatten`` + ``tree_unflatten`` of both trees made the donating step's trace about twice
    as long as the plain step's (54k more bytecode instructions with the bench's model, seconds of
    compile time and MiB of compile heap). Now the per-leaf copy adds about a fifth."""
    batch = lm_batch(TINY.vocab_size, microbatches=1, batch=2, seq=16)
    tx = adamw(1e-2, weight_decay=0.1)
    counts = {}
    for donate in (False, True):
        step = make_train_step(TINY, tx, backend="eager", donate_state=donate)
        state = tiny_state(tx)
        counts[donate] = traced_instructions(lambda: step(state, batch))
    assert counts[False] > 1000
    assert counts[True] <= 1.3 * counts[False], counts


def test_donating_step_refuses_leaves_that_share_storage():
    tx = adamw(1e-3)
    params = model.init(TINY, seed=0)
    params["final_norm"] = {"scale": params["layers"]["0"]["attn_norm"]["scale"]}
    step = make_train_step(TINY, tx, compile=False, donate_state=True)
    with pytest.raises(ValueError, match=r"layers\.0\.attn_norm\.scale.*final_norm\.scale.*share storage"):
        step(TrainState.create(params, tx), lm_batch(TINY.vocab_size, 1, 2, 8))


@pytest.mark.slow
def test_more_steps_than_dynamos_recompile_limit_each_compile_their_own_graph():
    """Every built step owns its Dynamo cache: building more steps than ``recompile_limit`` in one
    process (a learning-rate sweep) neither fails nor falls back, and each step keeps its own lr."""
    torch._dynamo.reset()
    batch = lm_batch(TINY.vocab_size, microbatches=1, batch=2, seq=16)
    params = model.init(TINY, seed=0)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    limit = torch._dynamo.config.recompile_limit
    moved = []
    for i in range(limit + 2):
        tx = adamw(1e-4 * (i + 1), weight_decay=0.0)
        step = make_train_step(TINY, tx, clip_grad=0.0, backend=counter)
        state, _ = step(TrainState.create(params, tx), batch)
        moved.append(float((state.params["embed"]["tokens"] - params["embed"]["tokens"]).abs().max()))
    assert counter.frame_count == limit + 2
    # Adam's first update moves each weight by about lr: the steps did not share a cached graph.
    assert moved == sorted(moved) and moved[-1] > 5 * moved[0]


def test_training_lowers_the_loss_on_a_fixed_stream(tiny_state):
    text = open(os.path.join(sysconfig.get_paths()["stdlib"], "this.py"), "rb").read()  # ships with Python
    stream = torch.tensor(list(text), dtype=torch.long) % TINY.vocab_size
    seq, batch_size = 32, 8
    tx = adamw(warmup_decay_schedule(3e-3, 3e-4, warmup_steps=10, decay_steps=200), weight_decay=0.01)
    step = make_train_step(TINY, tx, compile=False)
    state = tiny_state(tx)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(200):
        starts = torch.randint(0, len(stream) - seq - 1, (batch_size,), generator=g)
        windows = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
        state, metrics = step(state, {"tokens": windows[None, :, :-1], "labels": windows[None, :, 1:]})
        losses.append(float(metrics["loss"]))
    first, last = losses[0], sum(losses[-10:]) / 10
    assert first > 4.5  # about ln(128): an untrained model
    print(f"loss {first:.3f} -> {last:.3f}")
    assert last < 2.0, (first, last)  # 1.75 on torch 2.13 CPU


def test_dropout_in_the_step_depends_on_step_and_seed():
    cfg = dataclasses.replace(TINY, hidden_dropout=0.1)
    tx = record_grads()
    step = make_train_step(cfg, tx, clip_grad=0.0, compile=False)
    batch = lm_batch(cfg.vocab_size, 1, 2, 8)
    params = model.init(cfg, seed=0)
    a, _ = step(TrainState.create(params, tx, seed=0), batch)
    b, _ = step(TrainState.create(params, tx, seed=0), batch)
    c, _ = step(TrainState.create(params, tx, seed=1), batch)
    assert tree_max_abs_diff(a.opt_state, b.opt_state) == 0.0
    assert tree_max_abs_diff(a.opt_state, c.opt_state) > 0.0


def test_eval_step_sums_over_microbatches():
    batch = lm_batch(TINY.vocab_size, microbatches=3, batch=2, seq=8)
    params = model.init(TINY, seed=0)
    out = make_eval_step(TINY, compile=False)(params, batch)
    assert float(out["num_tokens"]) == float(batch["loss_mask"].sum())
    whole = make_eval_step(TINY, compile=False)(params, tree_map(lambda x: x.reshape(1, 6, 8), batch))
    torch.testing.assert_close(out["loss_sum"], whole["loss_sum"], rtol=1e-5, atol=1e-5)


def test_bad_batches_are_clear_errors(tiny_state):
    tx = adamw(1e-3)
    step = make_train_step(TINY, tx, compile=False)
    state = tiny_state(tx)
    good = lm_batch(TINY.vocab_size, 1, 2, 8)
    with pytest.raises(ValueError, match=r"\[microbatches, B, S\]"):
        step(state, {k: v[0] for k, v in good.items()})
    with pytest.raises(KeyError, match="labels"):
        step(state, {"tokens": good["tokens"]})
    with pytest.raises(KeyError, match="unknown keys"):
        step(state, {**good, "attention_mask": good["tokens"]})
