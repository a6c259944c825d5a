"""Sharded checkpoints of pytrees and the checkpoint manager (one process)."""

import json
import os

import pytest
import torch

from lmfunc import model
from lmfunc.checkpoint.manager import IN_PROGRESS, MARKER, TRACKER, CheckpointManager, latest_step, step_dir_name
from lmfunc.checkpoint.sharded import load_tree, save_tree, saved_tensors, stage_tree
from lmfunc.config.model import ConfigError, model_preset
from lmfunc.optim import adamw
from lmfunc.precision import LossScaleConfig
from lmfunc.train.state import TrainState
from lmfunc.tree import flatten_with_paths, tree_map


def _state(seed: int) -> TrainState:
    cfg = model_preset("tiny")
    state = TrainState.create(model.init(cfg, seed=seed), adamw(1e-3), seed=seed, loss_scale=LossScaleConfig())
    g = torch.Generator().manual_seed(seed)
    # Non-trivial optimizer moments and counters, so a wrong restore cannot pass by accident.
    state = state.replace(
        opt_state=tree_map(lambda x: torch.randn(x.shape, generator=g) if x.is_floating_point() else x + 7,
                           state.opt_state),
        step=torch.tensor(17), consumed_samples=torch.tensor(136),
    )
    return state


def _assert_equal(a, b) -> None:
    flat_a, flat_b = flatten_with_paths(a), flatten_with_paths(b)
    assert [n for n, _ in flat_a] == [n for n, _ in flat_b]
    for (name, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), name


def test_tree_round_trip_keeps_every_leaf_and_dtype(tmp_path):
    state = _state(0)
    state = state.replace(params={**state.params, "extra_bf16": torch.randn(3, 5).to(torch.bfloat16)})
    save_tree(state, str(tmp_path / "ck"))
    keys = saved_tensors(str(tmp_path / "ck"))
    assert keys["params.layers.1.attn.wq"] == ((64, 64), torch.float32)
    assert keys["params.extra_bf16"] == ((3, 5), torch.bfloat16)
    assert keys["opt_state.0.count"][1] == torch.int64
    like = _state(1).replace(params={**_state(1).params, "extra_bf16": torch.zeros(3, 5, dtype=torch.bfloat16)})
    _assert_equal(load_tree(like, str(tmp_path / "ck")), state)


def test_load_names_missing_and_misshapen_leaves(tmp_path):
    save_tree(_state(0), str(tmp_path / "ck"))
    wider = TrainState.create(model.init(model_preset("tiny", hidden_size=128), seed=0), adamw(1e-3),
                              loss_scale=LossScaleConfig())
    with pytest.raises(ValueError, match=r"params.embed.tokens: checkpoint \(128, 64\), expected \(128, 128\)"):
        load_tree(wider, str(tmp_path / "ck"))
    without_scaler = TrainState.create(model.init(model_preset("tiny"), seed=0), adamw(1e-3))
    with pytest.raises(ValueError, match="in the checkpoint but not expected: .*loss_scale.scale"):
        load_tree(without_scaler, str(tmp_path / "ck"))
    params = load_tree({"params": model.init(model_preset("tiny"), seed=5)}, str(tmp_path / "ck"), allow_unused=True)
    _assert_equal(params["params"], _state(0).params)


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_layout_tracker_and_keep(tmp_path, async_save):
    directory = str(tmp_path / "save")
    manager = CheckpointManager(directory, keep=2, async_save=async_save)
    for step in (10, 20, 30):
        manager.save(step, _state(step), files={"config.yaml": f"step: {step}\n"})
    manager.wait()
    assert sorted(os.listdir(directory)) == [step_dir_name(20), step_dir_name(30), TRACKER]
    assert open(os.path.join(directory, TRACKER)).read().strip() == "30"
    marker = json.load(open(os.path.join(directory, "iter_0000030", MARKER)))
    assert marker == {"sharded_backend": "torch_dcp", "sharded_backend_version": 1, "iteration": 30}
    assert open(os.path.join(directory, "iter_0000030", "config.yaml")).read() == "step: 30\n"
    assert latest_step(directory) == 30
    _assert_equal(manager.restore(_state(0), 20), _state(20))


def test_async_save_writes_the_state_given_while_training_goes_on(tmp_path):
    manager = CheckpointManager(str(tmp_path), async_save=True)
    state = _state(3)
    manager.save(5, state)
    # The step returns new tensors; the saved state is the one handed over, whatever comes next.
    later = state.replace(params=tree_map(lambda x: x * 2, state.params))
    assert manager.in_flight() in (5, None)
    manager.wait()
    assert manager.in_flight() is None and manager.last_saved == 5
    _assert_equal(manager.restore(_state(0), 5), state)
    assert not torch.equal(later.params["embed"]["tokens"], state.params["embed"]["tokens"])


def test_staged_async_save_keeps_the_state_given_while_it_is_overwritten_in_place(tmp_path):
    """A donating train step overwrites the state's tensors during the background write: with
    stage=True the checkpoint still holds the values handed over."""
    manager = CheckpointManager(str(tmp_path), async_save=True)
    state = _state(3)
    expected = tree_map(torch.clone, state)
    staged = stage_tree(state)
    assert all(torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
               for (_, a), (_, b) in zip(flatten_with_paths(state), flatten_with_paths(staged)))
    manager.save(5, state, stage=True)
    for _, leaf in flatten_with_paths(state):
        leaf.mul_(2) if leaf.is_floating_point() else leaf.add_(1)
    manager.wait()
    _assert_equal(manager.restore(_state(0), 5), expected)


def test_partial_saves_are_ignored_and_removed(tmp_path):
    directory = str(tmp_path)
    manager = CheckpointManager(directory, async_save=False)
    manager.save(10, _state(10))
    # A crash mid-save leaves lmfunc's .tmp directory with its in-progress marker: removed on reopening.
    os.makedirs(os.path.join(directory, "iter_0000020.tmp"))
    open(os.path.join(directory, "iter_0000020.tmp", IN_PROGRESS), "w").close()
    open(os.path.join(directory, "iter_0000020.tmp", "__0_0.distcp"), "w").write("partial")
    open(os.path.join(directory, TRACKER), "w").write("20\n")
    assert latest_step(directory) == 10
    reopened = CheckpointManager(directory)
    assert reopened.removed_partial == ["iter_0000020.tmp"]
    assert sorted(os.listdir(directory)) == ["iter_0000010", TRACKER]
    # Anything else named iter_* was not written by lmfunc: the directory is refused, nothing is deleted.
    os.makedirs(os.path.join(directory, "iter_0000030"))
    os.makedirs(os.path.join(directory, "iter_0000040.tmp"))
    with pytest.raises(ConfigError, match=r"iter_0000030 \(no lmfunc metadata.json.*iter_0000040.tmp \(an unfinished save without"):
        CheckpointManager(directory)
    assert sorted(os.listdir(directory)) == ["iter_0000010", "iter_0000030", "iter_0000040.tmp", TRACKER]
    with pytest.raises(FileNotFoundError, match="complete steps in .*: \\[10\\]"):
        reopened.restore(_state(0), 30)


class Killed(BaseException):
    """What a SIGKILL at that point would leave: the call stops there."""


def test_a_kill_while_a_save_is_created_or_an_old_one_deleted_leaves_a_save_dir_that_reopens(tmp_path, monkeypatch):
    """A save's directory appears under its ``iter_*.tmp`` name only with the in-progress marker in
    it, and a pruned checkpoint leaves its ``iter_*`` name before its files go: a kill at either
    moment leaves no unmarked ``iter_*`` entry (which a resume would refuse as not lmfunc's), and
    reopening removes the hidden leftovers and keeps the complete checkpoint."""
    import shutil

    import lmfunc.checkpoint.manager as manager_module

    directory = str(tmp_path)
    manager = CheckpointManager(directory, keep=1, async_save=False)
    manager.save(1, _state(1))

    def killed_before_the_marker(path, *args, **kwargs):
        raise Killed

    with monkeypatch.context() as patch:  # killed right after the directory was made
        patch.setattr(manager_module, "open", killed_before_the_marker, raising=False)
        with pytest.raises(Killed):
            manager.save(2, _state(2))
    assert not any(name.startswith("iter_0000002") for name in os.listdir(directory))

    real_rmtree = shutil.rmtree

    def killed_mid_delete(path, *args, **kwargs):
        if not os.path.isfile(os.path.join(path, MARKER)):
            return real_rmtree(path, *args, **kwargs)
        os.remove(os.path.join(path, MARKER))  # the marker went first, the shards are still there
        raise Killed

    with monkeypatch.context() as patch:  # keep=1: the save of step 3 prunes step 1, killed during it
        patch.setattr(shutil, "rmtree", killed_mid_delete)
        with pytest.raises(Killed):
            manager.save(3, _state(3))
    assert "iter_0000001" not in os.listdir(directory) and latest_step(directory) == 3

    reopened = CheckpointManager(directory, keep=1, async_save=False)
    assert sorted(os.listdir(directory)) == ["iter_0000003", TRACKER]
    _assert_equal(reopened.restore(_state(0), 3), _state(3))
