"""``lmfunc.model.stages``: each stage's parameter subtree under model-wide names."""

import dataclasses

import pytest

from lmfunc import model
from lmfunc.config import model_preset
from lmfunc.config.pipeline import pipeline_split
from lmfunc.model.stages import shared_leaves, stage_params
from lmfunc.tree import flatten_with_paths


def paths(tree):
    return {path for path, _ in flatten_with_paths(tree)}


@pytest.mark.parametrize("tie, mtp", [(True, 0), (False, 0), (False, 1)])
def test_the_stages_cover_the_tree_and_share_only_the_token_embedding(tie, mtp):
    cfg = dataclasses.replace(model_preset("tiny", num_layers=4), tie_embeddings=tie, mtp_num_layers=mtp)
    params = model.init(cfg, seed=0)
    split = pipeline_split(4, pp=2, schedule="interleaved-1f1b", virtual_stages=2)
    held = [paths(stage_params(params, cfg, split, s)) for s in range(split.num_stages)]
    assert set().union(*held) == paths(params)
    counts = {path: sum(path in stage for stage in held) for path in paths(params)}
    shared = {path for path, count in counts.items() if count > 1}
    assert shared == set(shared_leaves(cfg, split)) == ({"embed.tokens"} if tie or mtp else set())
    assert {p.split(".")[1] for p in held[2] if p.startswith("layers.")} == {"2"}  # model-wide layer names
    assert not any(p.startswith(("final_norm", "output", "mtp")) for p in held[0] | held[1] | held[2])
    leaf = stage_params(params, cfg, split, 3)["layers"]["3"]
    assert next(iter(leaf.values())) is next(iter(params["layers"]["3"].values()))  # the same tensors


def test_one_stage_holds_everything_and_shares_nothing():
    cfg = model_preset("tiny")
    params = model.init(cfg, seed=0)
    split = pipeline_split(cfg.num_layers, pp=1, schedule="gpipe")
    assert paths(stage_params(params, cfg, split, 0)) == paths(params) and shared_leaves(cfg, split) == ()
    with pytest.raises(ValueError, match=r"stage 1 is outside 0..0"):
        stage_params(params, cfg, split, 1)


@pytest.mark.parametrize("schedule, pp, virtual, first, last", [
    ("1f1b", 2, None, None, None), ("interleaved-1f1b", 2, 2, None, None), ("gpipe", 2, None, 1, None),
    ("zbv", 2, None, None, None), ("1f1b", 3, None, 1, 0),
])
def test_the_stages_composed_are_the_model(schedule, pp, virtual, first, last):
    """Stage by stage, in stage order, with dropout, reset positions, document masks and full
    recompute: the same hidden states as ``gpt.forward``, bit for bit."""
    import torch

    from lmfunc.model.stages import stage_forward

    cfg = dataclasses.replace(model_preset("tiny", num_layers=4), hidden_dropout=0.1, recompute_granularity="full")
    params = model.init(cfg, seed=0)
    split = pipeline_split(4, pp=pp, schedule=schedule, virtual_stages=virtual, first_stage_layers=first,
                           last_stage_layers=last)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16)
    doc_ids = torch.cat([torch.zeros(10, dtype=torch.long), torch.ones(6, dtype=torch.long)]).expand(2, 16)
    seed = torch.tensor(7)
    x = tokens
    for stage in range(split.num_stages):
        x, stats = stage_forward(stage_params(params, cfg, split, stage), x, cfg, split, stage, positions, doc_ids,
                                 seed)
        assert stats == []
    expected = model.forward(params, tokens, cfg, positions=positions, doc_ids=doc_ids, dropout_seed=seed)
    assert torch.equal(x, expected)
