"""Slice copies inside higher-order-operator bodies rewritten as a slice and a copy Inductor fuses.

AOTAutograd traces the body of torch's ``scan`` (``ModelConfig.scan_layers``: one transformer
block) again with views replaced by their ``*_copy`` ops. Inductor decomposes most of those back
into a view and a copy (``view_copy``, ``permute_copy``, ...), but not ``aten.slice_copy``, which
therefore runs as a separate ATen call on every iteration of the loop: RoPE's half-split slices of
q and k, four per block forward and four backward. ``decompose_slice_copies`` rewrites each into
``aten.slice`` (a view) and a contiguous ``aten.clone``, which Inductor fuses into the kernel that
reads it, as it does in the unrolled step. The values are the same, element for element.
"""

from __future__ import annotations

import torch
from torch import fx
from lmfunc.compiler.torch_compat.inductor import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
SLICE_COPY = aten.slice_copy.Tensor


def decompose_slice_copies(gm: fx.GraphModule) -> int:
    """Replace every ``aten.slice_copy`` of ``gm`` and of its nested graph modules (the bodies of
    its higher-order operators) by a contiguous ``clone`` of ``aten.slice``; returns how many. A
    node whose inputs carry no example value (``meta["val"]``) is left as it is."""
    rewritten = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        nodes = [node for node in graph.find_nodes(op="call_function", target=SLICE_COPY)
                 if all("val" in arg.meta for arg in node.all_input_nodes)]
        for node in nodes:
            with graph.inserting_before(node):
                view = graph.call_function(aten.slice.Tensor, node.args, node.kwargs)
                values = fx.map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
                view.meta["val"] = aten.slice.Tensor(*values[0], **values[1])
                copy = graph.call_function(aten.clone.default, (view,), {"memory_format": torch.contiguous_format})
                copy.meta.update(node.meta)
            node.replace_all_uses_with(copy)
            graph.erase_node(node)
        if nodes:
            module.recompile()
        rewritten += len(nodes)
    return rewritten


class SliceCopyPass(CustomGraphPass):
    """``decompose_slice_copies`` as an Inductor post-grad pass; its ``uuid`` hashes this file."""

    def __call__(self, graph: fx.Graph) -> None:
        decompose_slice_copies(graph.owning_module)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
