"""The backward's reversed scans lowered to loops that read and write their stacked tensors
backwards, instead of copying them reversed.

torch's ``scan`` autograd runs the backward of a scan over ``L`` layers as another scan over the
forward's stacked values reversed along dim 0: it flips every stacked input (the layers' parameters
and the saved activations) into a reversed copy, and flips each stacked gradient it returns back
into layer order, another copy. Inductor then lowers every scan to a ``while_loop`` whose
iteration ``i`` reads ``xs[i]`` and writes ``ys[i]`` (``decompose_scan_to_while_loop``).

``lower_reversed_scans`` lowers such a scan first, to a ``while_loop`` whose iteration ``i`` reads
``x[L-1-i]`` from the unflipped inputs and writes ``y[L-1-i]`` into the buffers the flipped
outputs' readers then read directly. The values are the same, element for element; the copies
(two per stacked leaf, each the size of all ``L`` layers' leaf) are gone. A scan whose scanned
inputs are not all flipped, or whose stacked outputs are read other than flipped, is left to
Inductor's lowering.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx
from lmfunc.compiler.torch_compat.inductor import CustomGraphPass, get_hash_for_files
from lmfunc.compiler.torch_compat.inductor import CallFunctionVarArgs, Match, PatternMatcherPass, register_graph_pattern
from lmfunc.compiler.torch_compat.tensors import pytree

SCAN = torch.ops.higher_order.scan
FLIPS = (torch.ops.aten.flip.default, torch.ops.prims.rev.default)
"""``torch.flip`` and what Inductor's decompositions make of it."""


def _flipped_source(node: object) -> Optional[fx.Node]:
    """The tensor that ``node`` reverses along dim 0 (``flip(x, [0])``, ``rev(x, [0])``), or None."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in FLIPS:
        source, dims = node.args[0], tuple(node.args[1])
        if dims == (0,) or dims == (-source.meta["val"].dim(),):
            return source
    return None


def _stacked_outputs(scan: fx.Node) -> Optional[list[fx.Node]]:
    """``scan``'s stacked-output readers (the ``getitem`` of each ``ys`` leaf) when each is read
    only by flips along dim 0, else None."""
    num_carry = len(scan.args[1])
    outputs = []
    for user in scan.users:
        if user.target is not operator.getitem:
            return None
        if user.args[1] >= num_carry:
            if not all(_flipped_source(reader) is user for reader in user.users):
                return None
            outputs.append(user)
    return outputs


def _reversible(scan: fx.Node) -> bool:
    """Every scanned input of ``scan`` is flipped along dim 0, every stacked output is only read
    flipped back, and every shape is static."""
    xs = scan.args[2]
    if not xs or any(_flipped_source(x) is None for x in xs) or _stacked_outputs(scan) is None:
        return False
    values = [node.meta.get("val") for node in scan.all_input_nodes if node.op != "get_attr"]
    return all(isinstance(v, torch.Tensor) and not any(isinstance(s, torch.SymInt) for s in v.shape)
               for v in pytree.tree_leaves(values) + list(pytree.tree_leaves(scan.meta["val"])))


def lower_reversed_scans(gm: fx.GraphModule) -> int:
    """Lower each scan of ``gm`` that ``_reversible`` accepts to a ``while_loop`` over the unflipped
    inputs, indexed backwards, and make the flipped outputs' readers read its outputs. Returns the
    number of scans lowered."""
    lowered = 0
    patterns = PatternMatcherPass()

    @register_graph_pattern(CallFunctionVarArgs(SCAN), extra_check=lambda match: _reversible(match.nodes[0]),
                            pass_dict=patterns)
    def _(match: Match, combine: fx.Node, init: list, xs: list, additional: list) -> None:
        nonlocal lowered
        scan = match.nodes[0]
        body: fx.GraphModule = getattr(gm, combine.target)
        num_carry = len(init)
        stacked_vals = pytree.tree_leaves(scan.meta["val"])[num_carry:]
        for output in _stacked_outputs(scan):
            for flip in list(output.users):
                flip.replace_all_uses_with(output)
                gm.graph.erase_node(flip)
        flat, spec = pytree.tree_flatten((list(init), [_flipped_source(x) for x in xs], list(additional)))

        def backwards_loop(*flat_args):
            """The scan over ``xs`` reversed, reading ``x[L-1-i]`` and writing ``y[L-1-i]``."""
            carry0, sources, extra = pytree.tree_unflatten(list(flat_args), spec)
            length = sources[0].size(0)
            buffers = [torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device) for v in stacked_vals]
            operands = (torch.zeros([], dtype=torch.int64), buffers, carry0, sources)
            flat_operands, operands_spec = pytree.tree_flatten(operands)
            _, all_spec = pytree.tree_flatten((*operands, extra))

            def cond_fn(*args):
                return pytree.tree_unflatten(list(args), all_spec)[0] < length

            def body_fn(*args):
                step, outs, carry, stacked, more = pytree.tree_unflatten(list(args), all_spec)
                i = step.item()
                torch.ops.aten._assert_scalar.default(i >= 0, "")
                torch.ops.aten._assert_scalar.default(i < length, "")
                results = body(*carry, *[x.select(0, length - 1 - i) for x in stacked], *more)
                for y, out in zip(results[num_carry:], outs):
                    out.select(0, length - 1 - i).copy_(y)
                return step + 1, *outs, *results[:num_carry], *stacked

            _, outs, carry, _ = pytree.tree_unflatten(
                torch.ops.higher_order.while_loop(cond_fn, body_fn, tuple(flat_operands), tuple(extra)), operands_spec)
            return list(carry) + list(outs)

        match.replace_by_example(backwards_loop, flat, run_functional_passes=False)
        lowered += 1

    patterns.apply(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return lowered


class ReversedScanPass(CustomGraphPass):
    """``lower_reversed_scans`` as an Inductor post-grad pass; its ``uuid`` hashes this file."""

    def __call__(self, graph: fx.Graph) -> None:
        lower_reversed_scans(graph.owning_module)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
