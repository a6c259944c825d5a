"""Communication accounting: the collectives of one microbatch's forward and backward, counted with
``CommDebugMode``, next to the numbers the layout should give.

Expected, for a model without MTP (L layers, U = parameter uses: every leaf once, the tied
embedding twice):
- FSDP (``dp_shard``): U all-gathers in the forward (each parameter gathered where it is used)
  and U reduce-scatters in the backward (their gradients); nothing else.
- TP without SP, Megatron's pattern: forward, an all-reduce after each row-parallel projection
  (2 per layer), one for the vocab-parallel embedding and 3 inside the vocab-parallel cross
  entropy (max, sum of exponentials, target logit): 2L + 4. Backward, Megatron's ``f``: one
  all-reduce of the input gradient of each column-parallel block (2 per layer, plus the output
  head's): 2L + 1. The cross entropy's backward stays on the vocabulary shards
  (``lmfunc.loss.vocab_parallel``): no collective.
- TP with SP: forward, a reduce-scatter after each row-parallel projection and the embedding, an
  all-gather before each column-parallel block and the head (2L + 1 each), the cross entropy's 3
  all-reduces. Backward, the mirror images: 2L + 1 reduce-scatters and 2L + 1 all-gathers. The norm scales' gradients are partial sums over the sequence shards:
  with FSDP too (dp_shard x tp), FSDP's reduce-scatter of each one's gradient first all-reduces
  it over tp, inside the backward (2L + 1 all-reduces); on a tp-only mesh that all-reduce happens
  after the backward, when the step matches the gradients' placements to the parameters'.

The compiled train step buckets them (``lmfunc.compiler.collective_buckets``). Expected for one
step of M microbatches (no MTP, no tp):
- FSDP: per microbatch one all-gather per region (embed, each block, head) in the forward, and
  each block's again in the backward (``lmfunc.compiler.regather``; the output layer's gradient is
  made in the forward, the embedding's needs no weight): 2L + 2; one reduce-scatter per region's
  gradients: L + 2, plus 1 with tied embeddings (the embedding's gradient from the output head
  comes at the start of the backward, its lookup's at the end; no bucket spans two microbatches:
  ``lmfunc.compiler.accumulation_order.mark_microbatch``). All-reduces: the global gradient norm
  over the shards.
- DDP (dp_replicate): the gradients in buckets of ``bucket_size_mb`` (one bucket for these
  models).
- With a loss mask, one more all-reduce: the step's token count.
- Context parallelism (``cp``): per microbatch, an all-gather of each layer's keys and of its
  values over ``cp`` in the forward and again in the backward (4L, each sending this rank's
  ``[B, S / cp, g, d]``; document ids add one per forward) and the reduce-scatter of their gradients in the backward (2L, each
  reducing the whole sequence's ``[B, S, g, d]``). The parameters are replicated over ``cp`` and
  their gradients partial sums: on a cp-only mesh the compiled step all-reduces them, with the
  loss sum, in one bucket (``bucket_size_mb``), as DDP does.
- On gloo, which has no reduce-scatter of its own, each bucketed FSDP reduce-scatter is an
  all-to-all and a local sum: the reduce-scatters above count as ``all_to_all_single``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Optional

from torch.distributed.tensor.debug import CommDebugMode
from torch.profiler import ProfilerActivity, profile
from torch.distributed.tensor.experimental import implicit_replication

from lmfunc.config import ModelConfig
from lmfunc.grad import value_and_grad
from lmfunc.loss import lm_loss
from lmfunc.model import gpt
from lmfunc.tree import tree_leaves

KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


def parameter_uses(cfg: ModelConfig) -> int:
    """How many times one forward pass uses a parameter leaf (the tied embedding counts twice)."""
    return len(tree_leaves(gpt.param_shapes(cfg))) + int(cfg.tie_embeddings)


def expected_counts(cfg: ModelConfig, sizes: dict[str, int]) -> Optional[dict[str, Counter]]:
    """``{"forward": Counter, "forward+backward": Counter}`` for this layout, or None when lmfunc
    makes no prediction (MTP, dp_replicate)."""
    if cfg.mtp_num_layers or sizes.get("dp_replicate", 1) > 1:
        return None
    forward, backward = Counter(), Counter()
    if sizes.get("dp_shard", 1) > 1:
        forward["all_gather_into_tensor"] += parameter_uses(cfg)
        backward["reduce_scatter_tensor"] += parameter_uses(cfg)
    layers = cfg.num_layers
    if sizes.get("cp", 1) > 1:
        forward["all_gather_into_tensor"] += 2 * layers
        backward["reduce_scatter_tensor"] += 2 * layers
    if sizes.get("tp", 1) > 1:
        if cfg.sequence_parallel:
            forward["reduce_scatter_tensor"] += 2 * layers + 1
            forward["all_gather_into_tensor"] += 2 * layers + 1
            forward["all_reduce"] += 3
            backward["reduce_scatter_tensor"] += 2 * layers + 1
            backward["all_gather_into_tensor"] += 2 * layers + 1
            if sizes.get("dp_shard", 1) > 1:
                backward["all_reduce"] += 2 * layers + 1
        else:
            forward["all_reduce"] += 2 * layers + 4
            backward["all_reduce"] += 2 * layers + 1
    return {"forward": forward, "forward+backward": forward + backward}


def expected_compiled_counts(cfg: ModelConfig, sizes: dict[str, int], microbatches: int,
                             loss_mask: bool, gloo: bool = True) -> Optional[dict[str, int]]:
    """Collectives of one compiled train step (module docstring), or None where lmfunc makes no
    prediction (tp, MTP, cp beside another dim, more than one gradient bucket). ``gloo``: the mesh's
    backend is gloo."""
    cp = sizes.get("cp", 1)
    if cfg.mtp_num_layers or sizes.get("tp", 1) > 1 or (cp > 1 and math.prod(sizes.values()) != cp):
        return None
    regions = cfg.num_layers + 2
    counts = {kind: 0 for kind in KINDS} | {"all_reduce": int(loss_mask)}
    reduce_scatters = "all_to_all_single" if gloo else "reduce_scatter_tensor"
    if cp > 1:
        counts["all_gather_into_tensor"] = microbatches * 4 * cfg.num_layers
        counts[reduce_scatters] = microbatches * 2 * cfg.num_layers
        counts["all_reduce"] += 1
    if sizes.get("dp_shard", 1) > 1:
        counts["all_gather_into_tensor"] = microbatches * (regions + cfg.num_layers)
        tied = int(cfg.tie_embeddings)
        counts[reduce_scatters] = microbatches * (regions + tied)
        counts["all_reduce"] += 1
    if sizes.get("dp_replicate", 1) > 1:
        counts["all_reduce"] += 1
    return counts


def expected_context_parallel_elements(cfg: ModelConfig, cp: int, batch: int, seq: int, microbatches: int,
                                       gloo: bool = True) -> dict[str, int]:
    """Elements the collectives of one compiled train step send on one rank of a cp-only mesh
    (module docstring): per microbatch of ``batch`` sequences of ``seq`` tokens, 4L key/value
    all-gathers of ``[batch, seq / cp, g, d]`` (forward and backward), 2L gradient reduce-scatters of ``[batch, seq, g, d]``
    (gloo's all-to-all takes the same input), and one all-reduce of every parameter's gradient and
    the loss sum (a partial sum over ``cp`` too, in the same bucket)."""
    kv = cfg.query_groups * cfg.head_dim
    reduce_scatters = "all_to_all_single" if gloo else "reduce_scatter_tensor"
    return {kind: 0 for kind in KINDS} | {
        "all_gather_into_tensor": microbatches * 4 * cfg.num_layers * batch * seq // cp * kv,
        reduce_scatters: microbatches * 2 * cfg.num_layers * batch * seq * kv,
        "all_reduce": sum(leaf.numel() for leaf in tree_leaves(gpt.param_shapes(cfg))) + 1,
    }


def _collective_events(call: Callable[[], object]) -> list:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    return [event for event in prof.events() if event.name.startswith("_c10d_functional::")]


def collective_kind(op_name: str) -> str:
    """The collective of a profiled ``_c10d_functional::`` op name, e.g. ``all_reduce`` for
    ``_c10d_functional::all_reduce_`` (in-place and ``_out`` variants count as their collective)."""
    return op_name.split("::", 1)[1].removesuffix("_out").rstrip("_")


def step_collectives(call: Callable[[], object]) -> tuple[dict[str, int], dict[str, int]]:
    """The collectives ``call()`` issues on this rank, by kind, and the elements they send (the
    first input's; a 0-dim tensor is one element), from one profile's host events (``_c10d_functional`` ops; an ``_out``
    variant counts as its op)."""
    counts, elements = Counter(), Counter()
    for event in _collective_events(call):
        kind = collective_kind(event.name)
        counts[kind] += 1
        elements[kind] += math.prod(event.input_shapes[0]) if event.input_shapes else 0  # a 0-dim tensor's [] is 1
    return {kind: counts.get(kind, 0) for kind in KINDS}, {kind: elements.get(kind, 0) for kind in KINDS}


P2P_EVENTS = {"gloo:send": "send", "gloo:recv": "recv"}
"""The profiler's events of gloo's point-to-point operations (their ``c10d::`` events carry no shapes)."""


def step_collectives_and_p2p(call: Callable[[], object]) -> dict[str, tuple[int, int]]:
    """Kind -> (count, elements) of what ``call()`` sends on this rank over gloo: the functional
    collectives (as ``step_collectives``) and the point-to-point sends and receives (a pipeline's)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    counts, elements = Counter(), Counter()
    for event in prof.events():
        if event.name.startswith("_c10d_functional::") and not event.name.startswith("_c10d_functional::wait"):
            kind = collective_kind(event.name)
        elif event.name in P2P_EVENTS:
            kind = P2P_EVENTS[event.name]
        else:
            continue
        counts[kind] += 1
        elements[kind] += math.prod(event.input_shapes[0]) if event.input_shapes else 0
    return {kind: (counts[kind], elements[kind]) for kind in counts}


def _counts(mode: CommDebugMode) -> Counter:
    return Counter({str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()})


def measure_counts(params, microbatch: dict, cfg: ModelConfig) -> dict[str, Counter]:
    """Collectives of ``lm_loss`` forward, and of forward + backward, for DTensor ``params`` and a
    DTensor ``microbatch`` (``[B, S]`` tensors)."""

    def objective(p):
        out = lm_loss(p, microbatch, cfg)
        return out.loss_sum, out

    with implicit_replication():
        with CommDebugMode() as forward:
            objective(params)
        with CommDebugMode() as both:
            value_and_grad(objective, has_aux=True)(params)
    return {"forward": _counts(forward), "forward+backward": _counts(both)}


def format_report(measured: dict[str, Counter], expected: Optional[dict]) -> str:
    """A table: one row per pass and collective kind, measured and expected."""
    lines = [f"{'pass':18s} {'collective':24s} {'measured':>9s} {'expected':>9s}"]
    for name, counts in measured.items():
        want = expected.get(name) if expected else None
        for kind in KINDS:
            lines.append(f"{name:18s} {kind:24s} {counts.get(kind, 0):9d} "
                         f"{'-' if want is None else want.get(kind, 0):>9}")
    return "\n".join(lines)
