import pytest
import torch

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.config.model import ConfigError
from lmfunc.config.train import OptimConfig, RunConfig, TrainConfig
from lmfunc.optim import scale_by_learning_rate
from lmfunc.optim.partition import masked, multi_transform, param_labels
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
from lmfunc.tree import flatten_with_paths, tree_map

CFG = TrainConfig(
    model=model_preset("tiny", position_embedding_type="learned_absolute", normalization="LayerNorm",
                       activation="gelu", add_bias_linear=True, tie_embeddings=False),
    optim=OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_iters=0, weight_decay=0.1, embedding_weight_decay=False,
                      decoupled_lr=5e-2, decoupled_min_lr=5e-3, scale_lr_patterns=("*.mlp.*",), lr_mult=0.5),
    run=RunConfig(train_iters=10),
)


def effective_hyperparameters(cfg: TrainConfig) -> dict[str, tuple[float, float]]:
    """``{leaf name: (lr, weight decay)}`` read off the first update of the real optimizer.

    With params 0 and gradients 1, Adam's first direction is 1 and decay adds nothing: the
    update is -lr. With params 1 and gradients 0, the direction is 0: the update is -lr * wd.
    """
    params = model.init(cfg.model, seed=0)
    plan = BatchPlan.from_config(cfg.run)
    main = build_lr_schedule(cfg, plan, cfg.run.train_iters)
    decoupled = build_lr_schedule(cfg, plan, cfg.run.train_iters, cfg.optim.decoupled_lr, cfg.optim.decoupled_min_lr)
    tx = build_optimizer(cfg, main, params, decoupled)
    zeros, ones = tree_map(torch.zeros_like, params), tree_map(torch.ones_like, params)
    lr_update, _ = tx.update(ones, tx.init(zeros), zeros)
    decay_update, _ = tx.update(zeros, tx.init(ones), ones)
    lrs = {name: -float(leaf.flatten()[0]) for name, leaf in flatten_with_paths(lr_update)}
    decays = {name: -float(leaf.flatten()[0]) for name, leaf in flatten_with_paths(decay_update)}
    return {name: (lrs[name], decays[name] / lrs[name]) for name in lrs}


def test_each_named_leaf_gets_its_groups_lr_and_decay():
    got = effective_hyperparameters(CFG)
    expected = {
        "embed.tokens": (5e-2, 0.0),          # decoupled lr; embeddings exempt from decay here
        "output": (5e-2, 0.0),
        "embed.positions": (1e-2, 0.0),       # not in Megatron's decoupled group
        "layers.0.attn.wq": (1e-2, 0.1),
        "layers.0.attn.bq": (1e-2, 0.0),      # biases never decay
        "layers.1.attn_norm.scale": (1e-2, 0.0),
        "layers.1.mlp.w_in": (5e-3, 0.1),     # lr_mult 0.5 by the *.mlp.* pattern
        "layers.1.mlp.b_out": (5e-3, 0.0),
        "final_norm.bias": (1e-2, 0.0),
    }
    for name, (lr, decay) in expected.items():
        assert got[name][0] == pytest.approx(lr, rel=1e-6), name
        assert got[name][1] == pytest.approx(decay, rel=1e-5, abs=1e-9), name


def test_defaults_decay_matrices_only_with_one_lr():
    cfg = TrainConfig(model=CFG.model, optim=OptimConfig(lr=1e-2, lr_warmup_iters=0), run=RunConfig(train_iters=10))
    got = effective_hyperparameters(cfg)
    assert all(lr == pytest.approx(1e-2) for lr, _ in got.values())
    assert got["embed.tokens"][1] == pytest.approx(0.1) and got["layers.0.mlp.b_in"][1] == 0.0


def test_decoupled_schedule_decays_to_its_own_minimum():
    plan = BatchPlan.from_config(CFG.run)
    decoupled = build_lr_schedule(CFG, plan, 10, CFG.optim.decoupled_lr, CFG.optim.decoupled_min_lr)
    assert float(decoupled(torch.tensor(0))) == pytest.approx(5e-2)
    assert float(decoupled(torch.tensor(10))) == pytest.approx(5e-3)


def test_masked_and_multi_transform_route_leaves():
    params = {"a": torch.ones(2, 2), "b": torch.ones(3)}
    only_matrices = masked(scale_by_learning_rate(2.0), lambda p: tree_map(lambda x: x.dim() == 2, p))
    out, _ = only_matrices.update(params, only_matrices.init(params), params)
    assert out["a"].eq(-2.0).all() and out["b"].eq(1.0).all()
    labels = param_labels(params, lambda name, leaf: "fast" if name == "a" else "slow")
    split = multi_transform({"fast": scale_by_learning_rate(3.0), "slow": scale_by_learning_rate(1.0)}, labels)
    out, _ = split.update(params, split.init(params), params)
    assert out["a"].eq(-3.0).all() and out["b"].eq(-1.0).all()
    with pytest.raises(ValueError, match="no transformation"):
        multi_transform({"fast": scale_by_learning_rate(1.0)}, labels).init(params)


def test_bad_group_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="optim.decoupled_min_lr needs optim.decoupled_lr"):
        TrainConfig(optim=OptimConfig(decoupled_min_lr=1e-4)).validate()
    with pytest.raises(ConfigError, match="optim.lr_mult"):
        TrainConfig(optim=OptimConfig(lr_mult=0.0)).validate()
