"""``lmfunc.compiler.regather``: what a compiled pipeline stage's forward keeps for its backward."""

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx.experimental.proxy_tensor import make_fx

from lmfunc.compiler.regather import tag_input_copies


def _saved(tag: bool) -> list[tuple[torch.dtype, tuple]]:
    """The values the forward of ``y = x @ w.bf16()`` hands its backward (``dx = dy @ w.bf16().T``),
    by AOTAutograd's partitioner, with or without ``tag_input_copies`` run on the joint graph first."""
    def joint(primals_1, primals_2, tangents_1):
        weight = primals_1.to(torch.bfloat16)
        return primals_2 @ weight, tangents_1 @ weight.t()

    args = (torch.randn(8, 16), torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16))
    graph = make_fx(joint)(*args)
    if tag:
        assert tag_input_copies(graph.graph) == 2  # the cast and its transpose; not the matmul
    forward, _ = min_cut_rematerialization_partition(graph, args, num_fwd_outputs=1)
    output = next(iter(forward.graph.find_nodes(op="output")))
    return [(node.meta["val"].dtype, tuple(node.meta["val"].shape)) for node in output.args[0][1:]]


def test_a_parameters_compute_copy_is_made_again_in_the_backward_not_kept():
    """A stage keeps one forward's values per microbatch in flight: a bf16 copy of a weight kept
    for the backward is a copy per microbatch in flight (as is the concatenation that puts together
    a leaf gathered over two mesh dims). Tagged, the forward keeps the fp32 parameter, which the
    state holds anyway, and the backward casts again."""
    assert _saved(tag=False) == [(torch.bfloat16, (16, 8))]
    assert _saved(tag=True) == [(torch.float32, (8, 16))]
