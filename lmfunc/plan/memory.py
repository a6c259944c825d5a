"""lmfunc's own memory prediction for one rank of a run, from its actual design.

What one rank holds during the compiled train step (``lmfunc.train.step``):

- **state**: fp32 master parameters and the two fp32 Adam moments of its shards (storage placements:
  FSDP over ``dp_shard``, Megatron's tensor split over ``tp``); the state is donated, so the update
  writes into it and no second copy exists;
- **gradients**: fp32, the same shards, accumulated over the microbatches;
- **compute copies**: with bf16/fp16 compute, the parameters cast once per step; under FSDP the
  parameters of the two largest regions in their compute layout (gathered over ``dp_shard``): the
  step gathers one region's while the one before computes, in the forward and again in the backward
  (``lmfunc.compiler.regather``), and keeps only the shards in between;
- **activations** of one microbatch: the values each layer keeps for its backward pass
  (``KEPT_PER_TOKEN``), the embedding, final norm and output layer's working set, and one chunk
  of logits (``model.cross_entropy_chunk_tokens``; all logits without chunking).

An MoE layer keeps, in place of the MLP's values, the values of each token's chosen experts and the
router's (``MOE_VALUES_PER_CHOICE``, ``ROUTER_VALUES_PER_EXPERT``), plus a shared expert's. A
multi-head latent attention layer keeps ``MLA_VALUES`` in place of the query, key and value terms
(measured without recompute only).

The peak is the state plus the compute copies plus the larger of the forward-backward working set
(activations, the output layer, the gradients made so far; with more than one microbatch, all the
gradients accumulated over the earlier ones) and the optimizer phase (all gradients).
The per-token coefficients count the tensors the compiled step keeps on CPU (fp32 and bf16, every
recompute granularity), measured with the allocator profiler; ``experiments/plan_accuracy``
checks the prediction against measurements.

With ``model.scan_layers`` the blocks' backward is one loop over stacked buffers: torch's scan keeps
what its own partitioner chooses whatever the recompute granularity (the no-recompute values), and
the layers' stacked fp32 gradients are held in full while every layer's values still are
(``SCAN_GRADIENT_COPIES``).

With context parallelism (``cp``) every per-token value counts this rank's ``seq / cp`` tokens,
the keys and values too: attention gathers them over ``cp`` in the forward and again in the
backward (``lmfunc.compiler.regather``), so a layer keeps only its own tokens'. The gradients are a bucket of every parameter's gradient from
the start of the backward (they are partial sums over ``cp``, all-reduced after it), and the peak
falls inside the last layer's attention backward: the kernel takes its mask as a dense
``[seq / cp, seq]`` tensor in the compute dtype (``ATTENTION_MASK_COPIES``), and makes the whole
sequence's key and value gradients (``attention_backward_bytes``).

On cuda the caching allocator also holds cuBLAS's workspace from the first matmul on
(``cublas_workspace_bytes``): torch's default is 32 MiB on compute capability 9.0 and newer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from lmfunc.config.model import ModelConfig
from lmfunc.config.parallel import data_parallel_size
from lmfunc.config.train import TrainConfig
from lmfunc.model import gpt
from lmfunc.parallel.sharding import COMPUTE_RULES, DEFAULT_RULES, local_shape
from lmfunc.tree import flatten_with_paths

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class LayerValues:
    """Values kept per token by one transformer layer for its backward pass, split by what they scale
    with: ``hidden`` (h), ``query`` (heads x head dim), ``kv`` (kv heads x head dim), ``ffn`` (the
    MLP width), ``heads``, and fp32 ``stats`` (norm and softmax statistics)."""

    hidden: float
    query: float
    kv: float
    ffn: float
    heads: float
    stats: float

    def per_token_bytes(self, cfg: ModelConfig, tp: int, sequence_parallel: bool, compute_bytes: int) -> float:
        """Bytes per token of one layer on one tensor-parallel rank: the split dimensions divided by
        ``tp``, the hidden-size values too with sequence parallelism."""
        hidden_split = tp if sequence_parallel else 1
        values = (self.hidden * cfg.hidden_size / hidden_split
                  + (self.query * cfg.num_attention_heads * cfg.head_dim + self.kv * cfg.query_groups * cfg.head_dim
                     + self.ffn * cfg.ffn_size) / tp)
        return values * compute_bytes + (self.heads * cfg.num_attention_heads / tp + self.stats) * 4


KEPT_PER_TOKEN = {
    # Both norm outputs, queries and the attention output, keys and values, the SwiGLU gate, up
    # projection and product (GeLU: its input and output); the attention log-sum-exp per head; two
    # norm statistics.
    "none": LayerValues(hidden=2, query=2, kv=2, ffn=3, heads=1, stats=2),
    # The compiled step's attention-core recompute keeps exactly what "none" keeps (measured to the
    # byte): the fused attention kernel keeps no score matrix for it to drop.
    "selective": LayerValues(hidden=2, query=2, kv=2, ffn=3, heads=1, stats=2),
    # The compiled step's full recompute drops the MLP's values but keeps the attention side's.
    "full": LayerValues(hidden=2, query=2, kv=2, ffn=1, heads=1, stats=2),
}
"""Per-layer values kept per token by the compiled step, by ``model.recompute_granularity`` (SwiGLU
counts; GeLU keeps one ffn-sized value fewer)."""

QK_NORM_VALUES = 1
"""With ``model.qk_layernorm``: the normed queries and keys, kept beside their inputs (measured on
the CPU with GQA 4/2 at width 256: 1.4% above this count)."""

MOE_VALUES_PER_CHOICE = {"hidden": 2, "expert_ffn": 3}
"""Values an MoE layer keeps per token and per chosen expert (compute dtype), in place of the dense
MLP's: the token's row gathered for its expert and the expert's output (which the routing weight
scales), and the expert's gate, up projection and their product. Fitted to the compiled step's
measured peaks on the CPU (top-1 of 4 experts of width 768, top-2 of 8 of width 256, and top-2 of 8
of width 128 beside a shared expert: within 3%)."""
ROUTER_VALUES_PER_EXPERT = 3
"""fp32 values an MoE layer keeps per token and expert: the router's logits and the scores of the
routing and of the balancing losses."""

EXPERT_PARALLEL_NOTE = ("dropless experts over ep are predicted at an even share of the routed rows per rank; the "
                        "most-loaded rank receives more (docs/performance.md)")
"""The plan's one assumption about routing under ep: the rows a rank's experts receive depend on
where the router sends the tokens, which the plan cannot know, so it counts an even share. The
measured cases are in docs/performance.md."""

MLA_VALUES = {"query_key": 2, "value": 3, "q_latent": 2, "kv_latent": 1.5, "probabilities": 1}
"""Values a multi-head latent attention layer keeps per token (compute dtype), in place of the
query, key and value terms of ``KEPT_PER_TOKEN`` (no recompute): its queries and keys (a heads of
``qk_head_dim + qk_pos_emb_head_dim``), its values and output (a heads of ``v_head_dim``, zero-padded
to the query width for the CPU's fused attention kernel, ``lmfunc.model.layers.fused_attention``),
the query latent and its normed copy and the key/value latent (and part of its normed copy).
Split over ``cp`` the attention runs SDPA's math kernel on the unpadded values, which also keeps
the softmax probabilities of every head over the ``seq`` keys. Fitted to five measured MLA cases
on the CPU (latents, head widths and the width varied: within 1.4%)."""

HEAD_VALUES_PER_TOKEN = 7
"""fp32 hidden-size values per token outside the layers while the output layer runs: the embedding
output, the final norm's input and output, the output layer's input gradient and the
residual-stream gradients."""

SCAN_GRADIENT_COPIES = 2
"""With ``scan_layers``: copies of all the layers' fp32 gradients held during the layers' backward,
next to every layer's kept values (the backward loop's stacked gradient buffers exist before its
first iteration). Two copies match the measured peaks of scanned models at widths 256 and 512 and
depths 4 and 8 (``experiments/plan_accuracy``)."""

RECOMPUTED_LAYERS_GRADS = 2
"""With full recompute the peak falls inside the layers' backward pass: it holds one layer's
recomputed MLP values and the gradients of about two layers (those being made and the last made)."""


ATTENTION_MASK_COPIES = 2
"""With ``cp`` > 1: the dense attention masks alive inside one layer's attention backward (the
recomputed boolean mask made additive in the compute dtype, and the kernel's copy of it), each
``[mask batch, seq / cp, seq]`` (mask batch: the micro batch with document masks, else 1)."""


STATE_TERM = "state and batch"
GRADIENTS_TERM = "gradients"
KEPT_TERM = "kept activations"
RECEIVE_TERM = "receive buffers"
WORKING_TERM = "working set"
"""The names of a peak's terms, shared by the plan (``MemoryPlan.terms``) and the dry run
(``lmfunc.dryrun``'s ``MemoryReport.terms``), which prints them side by side."""


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes on the most-loaded rank of a layout (``predict_memory``)."""

    sizes: dict[str, int]
    params: int
    """Parameter elements in this rank's shards."""
    state: int
    grads: int
    compute_copies: int
    activations: int
    """Kept by the layers for one microbatch."""
    scan_gradients: int
    """The scanned layers' stacked gradient buffers held during their backward (0 unrolled)."""
    head: int
    """Embedding, final norm, output layer and one logits chunk, for one microbatch."""
    peak: int
    attention_backward: int = 0
    """With ``cp``: one layer's attention backward (dense masks, query and gathered key/value
    gradients) on top of the kept values and the gradient bucket (0 without ``cp``)."""
    workspace: int = 0
    """CUDA libraries' workspace held by the caching allocator (cuBLAS; 0 on the CPU)."""
    notes: tuple[str, ...] = ()
    """What the user should know about the prediction (printed under it)."""
    chunks_in_flight: Optional[int] = None
    """Pipeline ranks: the stage-microbatches whose activations are held at once (``activations``
    counts them all, with their stage's output hidden states); None without a pipeline."""
    peak_phase: tuple[int, int, int] = (0, 0, 0)
    """One graph: the (gradients, kept activations, working set) of the phase at the peak, beside the
    state, the compute copies and the workspace (``predict_memory``)."""
    receive_buffers: int = 0
    """Pipeline ranks: the buffers torch's stages receive activations and gradients into, one per
    microbatch of each of the rank's stages, allocated at the first step and kept (0 without a
    pipeline)."""

    def terms(self) -> tuple[tuple[str, int], ...]:
        """The peak split as the dry run splits its own: the state, the gradients, the kept
        activations (for a pipeline rank those of its microbatches in flight, and its receive
        buffers) and the working set (compute copies, the output layer; for one graph what the phase
        at the peak computes)."""
        if self.chunks_in_flight is None:
            gradients, kept, working = self.peak_phase
            return ((STATE_TERM, self.state), (GRADIENTS_TERM, gradients), (KEPT_TERM, kept),
                    (WORKING_TERM, self.compute_copies + working + self.workspace))
        return ((STATE_TERM, self.state), (GRADIENTS_TERM, self.grads), (KEPT_TERM, self.activations),
                (RECEIVE_TERM, self.receive_buffers), (WORKING_TERM, self.compute_copies + self.head + self.workspace))

    def rows(self) -> list[tuple[str, int]]:
        kept = ("activations kept by the layers (1 microbatch)" if self.chunks_in_flight is None else
                f"activations, {self.chunks_in_flight} stage-microbatches in flight")
        return [("fp32 params + Adam moments (donated state)", self.state), ("fp32 gradients", self.grads),
                ("compute copies of the params" if self.chunks_in_flight is None else
                 "compute copies of one stage's params", self.compute_copies),
                (kept, self.activations),
                *([("scanned layers' stacked gradients (backward)", self.scan_gradients)] if self.scan_gradients else []),
                ("embedding, output layer and logits chunk", self.head),
                *([("attention backward over cp (masks, K/V grads)", self.attention_backward)]
                  if self.attention_backward else []),
                *([("cuBLAS workspace (CUDA)", self.workspace)] if self.workspace else []),
                *([("the stages' receive buffers (every microbatch)", self.receive_buffers)]
                  if self.receive_buffers else []),
                ("peak step memory", self.peak)]


def cublas_workspace_bytes(device: str) -> tuple[int, Optional[str]]:
    """Bytes of cuBLAS workspace that torch allocates through the CUDA caching allocator (so
    ``max_memory_allocated`` counts it) for a run on ``device`` ('auto', 'cpu' or 'cuda'), and a note
    when the GPU was assumed. ``CUBLAS_WORKSPACE_CONFIG`` (':SIZE_KiB:COUNT' pairs) decides; torch's
    default is ':4096:8' (32 MiB) on compute capability 9.0 and newer, ':4096:2:16:8' (8.125 MiB)
    before. Without a visible GPU a cuda plan assumes 9.0 (H100/H200)."""
    available = torch.cuda.is_available()
    if device == "cpu" or (device == "auto" and not available):
        return 0, None
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        return sum(1024 * int(size) * int(count) for size, count in pairs), None
    major = torch.cuda.get_device_capability()[0] if available else 9
    note = None if available else ("no GPU visible: the cuBLAS workspace assumes compute capability 9.0 "
                                   "(32 MiB; 8.125 MiB before 9.0)")
    return (32 * 2**20 if major >= 9 else 8 * 2**20 + 128 * 2**10), note


def local_params(cfg: ModelConfig, sizes: dict[str, int], data_parallel_sharded: bool = True, prefix: str = "") -> int:
    """Parameter elements on the most-loaded rank of a mesh of ``sizes``: storage shards, or with
    ``data_parallel_sharded=False`` the compute layout (FSDP shards gathered, the experts still
    split over ``ep``); only leaves whose
    dotted name starts with ``prefix`` (e.g. 'layers.0.')."""
    rules = DEFAULT_RULES if data_parallel_sharded else COMPUTE_RULES
    return sum(math.prod(local_shape(spec.shape, spec.axes, sizes, rules))
               for path, spec in flatten_with_paths(gpt.param_specs(cfg), is_leaf=lambda x: hasattr(x, "axes"))
               if path.startswith(prefix))


def _region(path: str) -> str:
    """The region (``lmfunc.parallel.placement.region``) whose collectives gather the leaf ``path``:
    ``embed``, ``layers.<i>``, ``mtp.<k>``, or ``head`` (final norm, output layer)."""
    parts = path.split(".")
    if parts[0] in ("layers", "mtp"):
        return ".".join(parts[:2])
    return "embed" if parts[0] == "embed" else "head"


def gathered_pair_elements(m: ModelConfig, sizes: dict[str, int]) -> int:
    """Parameter elements, in their compute layout (FSDP shards gathered), of the two largest
    regions: what the step holds gathered at once under FSDP (the tied embedding counts in both
    ``embed`` and ``head``, which gather it each)."""
    regions: dict[str, int] = {}
    for path, spec in flatten_with_paths(gpt.param_specs(m), is_leaf=lambda x: hasattr(x, "axes")):
        elements = math.prod(local_shape(spec.shape, spec.axes, sizes, COMPUTE_RULES))
        regions[_region(path)] = regions.get(_region(path), 0) + elements
        if m.tie_embeddings and path == "embed.tokens":
            regions["head"] = regions.get("head", 0) + elements
    return sum(sorted(regions.values())[-2:])


def layer_kept_bytes(cfg: TrainConfig, tp: int, granularity: str, cp: int = 1, moe: bool = False) -> float:
    """Bytes one transformer layer keeps for its backward pass over one microbatch on one
    tensor-parallel rank of a ``cp``-way context-parallel group (``KEPT_PER_TOKEN`` per local
    token, the keys and values too: gathered over ``cp`` again in the backward; GeLU keeps
    one ffn-sized value fewer, QK-norm ``QK_NORM_VALUES`` more of queries and keys). An MoE layer (``moe``) keeps ``MOE_VALUES_PER_CHOICE`` for each of
    a token's experts and ``ROUTER_VALUES_PER_EXPERT`` instead of the MLP's values, plus a shared
    expert's as a dense MLP of its width (the experts are not split over ``tp``)."""
    m = cfg.model
    kept = KEPT_PER_TOKEN[granularity]
    if m.activation != "swiglu":
        kept = dataclasses.replace(kept, ffn=max(kept.ffn - 1, 0))
    if m.qk_layernorm:
        kept = dataclasses.replace(kept, query=kept.query + QK_NORM_VALUES, kv=kept.kv + QK_NORM_VALUES)
    tokens = cfg.run.micro_batch_size * cfg.data.seq_length
    compute_bytes = DTYPE_BYTES[cfg.precision.compute_dtype]
    moe_extra = 0.0
    if moe:
        shared = m.moe_shared_expert_intermediate_size or 0
        moe_extra = (m.moe_router_topk * (MOE_VALUES_PER_CHOICE["hidden"] * m.hidden_size
                                          + MOE_VALUES_PER_CHOICE["expert_ffn"] * m.expert_ffn_size) * compute_bytes
                     + (kept.ffn * shared / tp - kept.ffn * m.ffn_size / tp) * compute_bytes
                     + ROUTER_VALUES_PER_EXPERT * m.num_experts * 4)
    if m.multi_latent_attention:
        standard = dataclasses.replace(kept, query=0, kv=0)
        a = m.num_attention_heads / tp
        latent = m.kv_lora_rank * MLA_VALUES["kv_latent"] + (m.q_lora_rank or 0) * MLA_VALUES["q_latent"]
        query_key = m.qk_head_dim + m.qk_pos_emb_head_dim
        # one rank's sequence: the fused kernel on values padded to the query width; split over cp:
        # the math kernel, which keeps the probabilities over the whole sequence
        value_width, probabilities = (max(query_key, m.v_head_dim), 0) if cp == 1 else (m.v_head_dim, cfg.data.seq_length)
        mla_values = (MLA_VALUES["query_key"] * a * query_key + MLA_VALUES["value"] * a * value_width + latent
                      + MLA_VALUES["probabilities"] * a * probabilities)
        per_token = standard.per_token_bytes(m, tp, m.sequence_parallel and tp > 1, compute_bytes) + moe_extra
        return tokens / cp * (per_token + mla_values * compute_bytes)
    per_token = kept.per_token_bytes(m, tp, m.sequence_parallel and tp > 1, compute_bytes) + moe_extra
    return tokens / cp * per_token


def attention_backward_bytes(cfg: TrainConfig, tp: int, cp: int) -> int:
    """With ``cp`` > 1, what one layer's attention backward adds on one rank: the dense masks
    (``ATTENTION_MASK_COPIES``), the whole sequence's keys and values gathered again, and the
    gradients of its local queries and of the whole sequence's keys and values (reduce-scattered
    over ``cp`` after it; MLA's of every head); 0 without ``cp``."""
    if cp == 1:
        return 0
    m, b, s = cfg.model, cfg.run.micro_batch_size, cfg.data.seq_length
    compute_bytes = DTYPE_BYTES[cfg.precision.compute_dtype]
    mask_batch = b if cfg.data.reset_attention_mask else 1
    masks = ATTENTION_MASK_COPIES * mask_batch * (s // cp) * s * compute_bytes
    if m.multi_latent_attention:
        query_key = m.qk_head_dim + m.qk_pos_emb_head_dim
        widths = m.num_attention_heads * (s // cp * query_key + 2 * s * (query_key + m.v_head_dim))
    else:
        widths = (s // cp * m.num_attention_heads + 4 * s * m.query_groups) * m.head_dim
    return int(masks + b * widths / tp * compute_bytes)


def head_bytes(cfg: TrainConfig, tp: int, cp: int = 1) -> int:
    """The working set outside the layers while the output layer runs over one microbatch on a rank
    holding ``seq / cp`` of every sequence (``HEAD_VALUES_PER_TOKEN`` fp32 hidden-size values per
    token and one logits chunk)."""
    m = cfg.model
    tokens = cfg.run.micro_batch_size * cfg.data.seq_length // cp
    chunk = tokens if m.cross_entropy_chunk_tokens == 0 else min(tokens, m.cross_entropy_chunk_tokens)
    return int(4 * tokens * m.hidden_size * HEAD_VALUES_PER_TOKEN + 4 * chunk * m.vocab_size / tp)


def predict_memory(cfg: TrainConfig, sizes: dict[str, int]) -> MemoryPlan:
    """lmfunc's peak step memory on the most-loaded rank of the mesh ``sizes`` (mesh dim -> size):
    the state and compute copies plus the largest of three phases: the output layer's (the layers'
    kept values and the head's working set; with ``scan_layers`` also the stacked layer gradients),
    inside the layers' backward (with full recompute: the kept values, one recomputed MLP and about
    two layers' gradients; with ``cp``: the kept values, the gradient bucket and one attention
    backward's masks and gradients) and the optimizer's (all gradients)."""
    m = cfg.model
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    compute_bytes = DTYPE_BYTES[cfg.precision.compute_dtype]
    params = local_params(m, sizes)
    state, grads = 12 * params, 4 * params
    gathered = local_params(m, sizes, data_parallel_sharded=False)
    low_precision = compute_bytes < 4
    fsdp = gathered != params
    compute_copies = compute_bytes * (gathered_pair_elements(m, sizes) if fsdp else gathered if low_precision else 0)
    tokens = cfg.run.micro_batch_size * cfg.data.seq_length // cp
    scanned = m.num_layers if m.scan_layers else 0
    unrolled = m.num_layers + m.mtp_num_layers - scanned
    moe_layers = sum(m.moe_layers) + (m.mtp_num_layers if m.moe_layers[-1] else 0)
    activations = int(scanned * layer_kept_bytes(cfg, tp, "none", cp)
                      + (unrolled - moe_layers) * layer_kept_bytes(cfg, tp, m.recompute_granularity, cp)
                      + (moe_layers * layer_kept_bytes(cfg, tp, m.recompute_granularity, cp, moe=True) if moe_layers else 0))
    scan_gradients = SCAN_GRADIENT_COPIES * 4 * local_params(m, sizes, prefix="layers.") if scanned else 0
    head = head_bytes(cfg, tp, cp)
    # from the second microbatch on, the gradients accumulated over the earlier ones are held too
    dp = data_parallel_size(sizes)
    accumulating = bool(cfg.run.global_batch_size) and cfg.run.global_batch_size > cfg.run.micro_batch_size * dp
    # each phase's (gradients, kept activations, working set) beside the state and the compute copies
    phases = [(scan_gradients + (grads if accumulating else 0), activations, head), (grads, 0, 0)]
    attention_backward = attention_backward_bytes(cfg, tp, cp)
    if cp > 1:
        phases.append((grads, activations, attention_backward))
    if m.recompute_granularity == "full" and not scanned:
        layer_grads = 4 * local_params(m, sizes, prefix="layers.0.")
        recomputed_mlp = tokens * compute_bytes * (3 if m.activation == "swiglu" else 2) * m.ffn_size / tp
        phases.append((RECOMPUTED_LAYERS_GRADS * layer_grads, activations, int(recomputed_mlp)))
    largest_phase = max(phases, key=sum)
    workspace, workspace_note = cublas_workspace_bytes(cfg.run.device)
    peak = state + compute_copies + sum(largest_phase) + workspace
    notes = (workspace_note,) if workspace_note else ()
    if sizes.get("ep", 1) > 1 and m.num_experts is not None and m.moe_expert_capacity_factor is None:
        notes += (EXPERT_PARALLEL_NOTE,)
    if scanned and m.recompute_granularity != "none":
        notes += (f"model.recompute_granularity={m.recompute_granularity} saves no memory with model.scan_layers "
                 "(torch's scan keeps the values its own partitioner chooses), so this counts what no recompute "
                 "keeps; unrolled layers (--model.no-scan-layers) recompute",)
    return MemoryPlan(sizes=dict(sizes), params=params, state=state, grads=grads, compute_copies=compute_copies,
                      activations=activations, scan_gradients=scan_gradients, head=head, peak=peak,
                      attention_backward=attention_backward, workspace=workspace, notes=notes,
                      peak_phase=largest_phase)
