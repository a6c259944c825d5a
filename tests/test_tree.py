import torch

from lmfunc.tree import (
    Axes, flatten_with_paths, tree_bytes, tree_map, tree_map_with_path, tree_max_abs_diff, tree_size,
)


def test_flatten_with_paths_gives_dotted_stable_names():
    tree = {"layers": {"0": {"attn": {"wq": torch.zeros(2, 3)}}, "1": {"b": torch.ones(4)}}, "e": torch.ones(1)}
    names = [name for name, _ in flatten_with_paths(tree)]
    assert names == ["layers.0.attn.wq", "layers.1.b", "e"]


def test_axes_are_leaves_that_line_up_with_params():
    params = {"w": torch.zeros(2, 3), "n": {"scale": torch.ones(3)}}
    axes = {"w": Axes(("embed", "mlp")), "n": {"scale": Axes(("embed",))}}
    ranks = tree_map(lambda p, a: p.dim() == len(a), params, axes)
    assert ranks == {"w": True, "n": {"scale": True}}
    assert [a for _, a in flatten_with_paths(axes)] == [("embed", "mlp"), ("embed",)]


def test_sizes_and_diffs():
    tree = {"a": torch.zeros(2, 3), "b": [torch.zeros(5, dtype=torch.float16)]}
    assert tree_size(tree) == 11
    assert tree_bytes(tree) == 6 * 4 + 5 * 2
    other = tree_map_with_path(lambda name, x: x + (1.0 if name == "b.0" else 0.0), tree)
    assert tree_max_abs_diff(tree, other) == 1.0
