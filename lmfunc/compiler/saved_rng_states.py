"""A recomputed random op's saved RNG state, placed where AOTAutograd reads it (torch 2.13).

When a checkpointed region (``lmfunc.model.recompute.checkpointed``: selective or full recompute)
holds an op tagged ``nondeterministic_seeded`` (``scaled_dot_product_attention``, for its dropout)
and AOTAutograd's partitioner recomputes it in the backward, ``functionalize_rng_ops`` saves the
RNG state the forward used: one more forward output and one more backward input. It inserts the
output just before the saved symbolic ints, but the forward's outputs end with the saved opaque
objects (a ``DeviceMesh``, when a compiled function builds DTensors on the mesh, as a pipeline
stage does) and then the ints; AOTAutograd's runtime counts from the end and takes the mesh for a
saved tensor ("expected all tensors_saved_with_vc_check to be Tensors"). A compiled pipeline stage
with recompute on a data or tensor-parallel mesh failed at its first step.

``saved_rng_states_before_opaque_objects()`` makes the states what AOTAutograd's runtime expects:
the last saved tensors, before the opaque objects, in the forward's outputs and in the backward's
inputs alike. Without opaque objects the partitioner's own result is kept unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

from torch import fx

RNG_STATE_INPUT = "rng_state_output_"
"""The prefix of the backward inputs ``functionalize_rng_ops`` adds."""


def _is_opaque(node) -> bool:
    from lmfunc.compiler.torch_compat.tracing import is_opaque_node

    return is_opaque_node(node)


def _trailing_opaque_outputs(fw_module: fx.GraphModule, num_sym_nodes: int) -> int:
    """How many opaque objects the forward's outputs hold just before its last ``num_sym_nodes``."""
    outputs = next(iter(fw_module.graph.find_nodes(op="output"))).args[0]
    count = 0
    for node in reversed(outputs[:len(outputs) - num_sym_nodes]):
        if not _is_opaque(node):
            break
        count += 1
    return count


def _move_rng_inputs_before_opaque(bw_module: fx.GraphModule) -> None:
    """The backward's RNG-state inputs moved in front of its first opaque input."""
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    first_opaque = next((node for node in placeholders if _is_opaque(node)), None)
    if first_opaque is None:
        return
    for node in placeholders:
        if node.name.startswith(RNG_STATE_INPUT):
            first_opaque.prepend(node)
    bw_module.recompile()


@contextlib.contextmanager
def saved_rng_states_before_opaque_objects() -> Iterator[None]:
    """While inside: the partitioner saves a recomputed random op's RNG state among the saved
    tensors, before the saved opaque objects (module docstring)."""
    from lmfunc.compiler.torch_compat.tracing import partitioners

    functionalize = partitioners.functionalize_rng_ops

    def placed(joint_module, fw_module, bw_module, num_sym_nodes):
        opaque = _trailing_opaque_outputs(fw_module, num_sym_nodes)
        fw_module, bw_module = functionalize(joint_module, fw_module, bw_module, num_sym_nodes + opaque)
        if opaque:
            _move_rng_inputs_before_opaque(bw_module)
        return fw_module, bw_module

    with mock.patch.object(partitioners, "functionalize_rng_ops", placed):
        yield

