"""What the model itself needs to know about layouts (no model imports, so layers can use it).

``gather(p)``: a parameter in its compute layout (FSDP shards all-gathered over the data-parallel
dims; tensor-parallel shards kept); ``gather_experts(p)`` keeps the expert-parallel split too.
``run_local(fn, ...)``: run a kernel that has no DTensor sharding rule (CPU attention) on each
rank's local shards; every input must be split only along dims the kernel treats independently
(batch, heads), so the local gradients are already the right shards. ``run_on_tokens(fn, ...)``:
the same for token-wise work (the MoE experts) on ``tokens_as_rows``, every rank's own tokens as
rows. ``region(name)``: marks the graph nodes a model region traces (``embed``, ``layers.<i>``,
``head``), which the compiler's collective pass buckets by (``lmfunc.compiler.collective_buckets``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import local_map
from torch.fx.traceback import annotate

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard", "ep")
"""The mesh dims that split the batch (``ep`` among them: expert-parallel ranks are data-parallel
ranks for everything but the experts)."""
EP_DIM = "ep"
REGION_KEY = "lmfunc_region"
"""Key of the region mark in a traced node's ``meta["custom"]``."""


@contextlib.contextmanager
def region(name: str):
    """Mark what is traced inside as model region ``name`` (``torch.fx.traceback.annotate``); a
    no-op for eager execution. The parameters a region gathers are gathered in one collective
    when compiled."""
    with annotate({REGION_KEY: name}):
        yield


def compute_placements(placements: Sequence[Placement], mesh, keep: Sequence[str] = ()) -> list[Placement]:
    """``placements`` with the data-parallel dims replicated (except those in ``keep``): what a
    layer computes with."""
    return [Replicate() if name in DATA_PARALLEL_DIMS and name not in keep else p
            for name, p in zip(mesh.mesh_dim_names, placements)]


def gather(p: torch.Tensor, keep: Sequence[str] = ()) -> torch.Tensor:
    """A parameter in its compute layout: FSDP shards all-gathered (over the data-parallel dims not
    in ``keep``); plain tensors unchanged."""
    if not isinstance(p, DTensor):
        return p
    want = compute_placements(p.placements, p.device_mesh, keep)
    return p if list(p.placements) == want else p.redistribute(p.device_mesh, want)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for activations ``[B, S, in]`` and a weight ``[in, out]`` in its compute layout:
    ``[B, S, out]``. Activations split along both the batch and the sequence (over ``dp_shard`` and
    ``cp``, or ``tp`` with SP) are multiplied as rows ``[B * S, in]``, each rank its own tokens:
    torch 2.13 cannot flatten a DTensor split along two dims inside ``torch.compile`` (the view
    leaves unbound run-time sizes, Dynamo's ``PendingUnbackedSymbolNotFound``). Column- and
    row-parallel weights keep their output layouts (a split ``out`` dim, a ``Partial`` sum)."""
    if not isinstance(x, DTensor) or not {0, 1} <= {p.dim for p in x.placements if isinstance(p, Shard)}:
        return x @ w
    out = _as_rows(x, _row_placements(x, features=True)) @ w
    if any(isinstance(p, Shard) and p.dim < 2 and o != Shard(0) for p, o in zip(x.placements, out.placements)):
        raise ValueError(f"linear: a weight {tuple(w.placements)} split over the dims that split the tokens "
                         f"{tuple(x.placements)}; gather it first (placement.gather)")
    placements = [p if isinstance(p, Shard) and p.dim < 2 else Shard(o.dim + 1) if isinstance(o, Shard) else o
                  for p, o in zip(x.placements, out.placements)]
    return _as_tokens(out, x, placements)


def gather_experts(p: torch.Tensor) -> torch.Tensor:
    """Routed-expert weights ``[E, ...]`` in their compute layout: gathered over the
    expert-data-parallel dims, each rank keeping its ``E / ep`` experts."""
    return gather(p, keep=(EP_DIM,))


def run_local(fn: Callable[..., torch.Tensor], *args):
    """``fn(*args)``; when the first argument is a DTensor, on the local shards of every tensor
    argument (``local_map``), the output taking the first argument's placements."""
    first = args[0]
    if not isinstance(first, DTensor):
        return fn(*args)
    in_placements = tuple(list(a.placements) if isinstance(a, DTensor) else None for a in args)
    mapped = local_map(fn, out_placements=list(first.placements), in_placements=in_placements,
                       device_mesh=first.device_mesh)
    return mapped(*args)


def tokens_as_rows(x: torch.Tensor) -> torch.Tensor:
    """Activations ``[B, S, ...]`` as rows ``[B * S, ...]``, one per token, for token-wise work (the
    MoE router and experts). A DTensor is flattened rank by rank: each rank's local tokens become
    its rows, split (``Shard(0)``) over every mesh dim that split the batch or the sequence (the
    sequence over ``cp``), so no tokens move. The global row order is then rank-major, not the
    tokens' order, which token-wise work does not see; ``rows_as_tokens`` undoes it."""
    if not isinstance(x, DTensor):
        return x.reshape(-1, *x.shape[2:])
    return _as_rows(x, _row_placements(x))


def rows_as_tokens(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of ``tokens_as_rows``: ``rows`` ``[B * S, ...]`` back as ``[B, S, ...]`` in the layout
    of ``like`` (the activations ``tokens_as_rows`` flattened)."""
    if not isinstance(like, DTensor):
        return rows.reshape(*like.shape[:2], *rows.shape[1:])
    want = _row_placements(like)
    if list(rows.placements) != want:
        rows = rows.redistribute(rows.device_mesh, want)
    return _as_tokens(rows, like, list(like.placements))


def _as_rows(x: DTensor, placements: list[Placement]) -> DTensor:
    """``x`` ``[B, S, ...]`` as rows ``[B * S, ...]`` in ``placements``: each rank's local tokens
    become its rows."""
    shape = (x.shape[0] * x.shape[1], *x.shape[2:])
    local = x.to_local()
    return DTensor.from_local(local.reshape(-1, *local.shape[2:]), x.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_strides(shape))


def _as_tokens(rows: DTensor, like: DTensor, placements: list[Placement]) -> DTensor:
    """``_as_rows`` undone: each rank's rows back as its tokens ``[B, S, ...]`` of ``like``, in
    ``placements``."""
    local_like = like.to_local()
    local = rows.to_local().reshape(*local_like.shape[:2], *rows.to_local().shape[1:])
    shape = (*like.shape[:2], *rows.shape[1:])
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_strides(shape))


def _row_placements(x: DTensor, features: bool = False) -> list[Placement]:
    """The placements of ``x``'s rows: ``Shard(0)`` where ``x`` is split along the batch or the
    sequence, the others kept; a split feature dim moves down one (``features``) or is refused
    (token-wise work needs whole tokens)."""
    if not features and any(isinstance(p, Shard) and p.dim not in (0, 1) for p in x.placements):
        raise ValueError(f"tokens_as_rows: activations split along a feature dim ({x.placements}) are not tokens")
    return [Shard(0) if isinstance(p, Shard) and p.dim < 2 else Shard(p.dim - 1) if isinstance(p, Shard) else p
            for p in x.placements]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def run_on_tokens(fn: Callable, tokens: torch.Tensor, *args, per_token: int = 1, sums: int = 0,
                  sequence_sums: int = 0):
    """``fn(tokens, *args)`` on each rank's own tokens, for a computation without DTensor sharding
    rules (the MoE experts): ``tokens`` and every argument as local shards. A per-token argument
    has ``tokens``' placements; a weight in its compute layout is whole except along dims it is
    sharded on. Its gradient is ``Partial`` over the mesh dims that split the tokens and not the
    weight, since each rank's tokens contribute their part; along a dim that splits both (the
    experts over ``ep``) it stays a shard, so ``fn`` must itself bring every rank's tokens to the
    shard they need (``lmfunc.parallel.expert_parallel``'s all-to-all). ``fn`` returns
    ``per_token`` tensors (in ``tokens``' placements), then ``sums`` sums over the local tokens
    (``Partial`` over the token-splitting dims, so they are reduced where they are used), then, for
    ``tokens`` ``[B, S, ...]``, ``sequence_sums`` sums over each local sequence part ``[B, ...]``
    (split along the batch like ``tokens``, ``Partial`` over the dims that split the sequence, such
    as ``cp``). Plain tensors: ``fn(tokens, *args)``."""
    if not isinstance(tokens, DTensor):
        return fn(tokens, *args)
    placements = list(tokens.placements)
    split = [isinstance(p, Shard) for p in placements]

    def grad_layout(a):
        if not isinstance(a, DTensor):
            return None
        return [p if isinstance(p, Shard) else Partial() if s else p for s, p in zip(split, a.placements)]

    args = (tokens, *args)
    per_sequence = [p if p == Shard(0) else Partial() if s else p for s, p in zip(split, placements)]
    outputs = ([placements] * per_token + [[Partial() if s else p for s, p in zip(split, placements)]] * sums
               + [per_sequence] * sequence_sums)
    mapped = local_map(fn, out_placements=tuple(outputs) if len(outputs) > 1 else outputs[0],
                       in_placements=tuple(list(a.placements) if isinstance(a, DTensor) else None for a in args),
                       in_grad_placements=tuple(map(grad_layout, args)), device_mesh=tokens.device_mesh)
    return mapped(*args)


def replicated(x: torch.Tensor) -> torch.Tensor:
    """``x`` whole on every rank: a DTensor's shards gathered and partial sums reduced; plain
    tensors unchanged."""
    if not isinstance(x, DTensor):
        return x
    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)


def _tp_placement(x: DTensor, tp: Placement) -> list[Placement]:
    return [tp if name == "tp" else p for name, p in zip(x.device_mesh.mesh_dim_names, x.placements)]


def residual_layout(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Activations ``[B, S, h]`` in the residual stream's layout: replicated over ``tp``, or split
    along the sequence with sequence parallelism. A ``Partial`` sum from a row-parallel projection
    becomes an all-reduce (or, with SP, a reduce-scatter); plain tensors pass through."""
    if not isinstance(x, DTensor) or "tp" not in x.device_mesh.mesh_dim_names:
        return x
    want = _tp_placement(x, Shard(1) if sequence_parallel else Replicate())
    return x if list(x.placements) == want else x.redistribute(x.device_mesh, want)


def _reduce_grad_here(x: DTensor) -> DTensor:
    """Megatron's ``f``: ``x`` unchanged; in the backward its gradient (a ``Partial`` sum over ``tp``
    from the column-parallel projections) is redistributed to ``x``'s placements right here (an
    all-reduce). ``DTensor.from_local`` of ``x``'s local tensor does that in its backward, eager and
    compiled alike; an ``autograd.Function`` does not under ``torch.compile`` (torch 2.13 traces its
    backward with the gradient already in ``x``'s placements and drops the all-reduce). Without the
    all-reduce the partial sum flows on through the residual stream, and every row-parallel
    weight's backward all-gathers the weight over ``tp`` and multiplies it whole
    (``tests/test_dryrun.py`` checks the FLOPs against Megatron's count)."""
    return DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=x.stride())


def compute_layout(x: torch.Tensor) -> torch.Tensor:
    """Activations replicated over ``tp`` for a column-parallel projection: with SP an all-gather
    of the sequence (its backward a reduce-scatter); without SP Megatron's ``f`` (the backward
    all-reduces the input gradient once)."""
    if not isinstance(x, DTensor) or "tp" not in x.device_mesh.mesh_dim_names:
        return x
    want = _tp_placement(x, Replicate())
    if list(x.placements) == want:
        return _reduce_grad_here(x)
    return x.redistribute(x.device_mesh, want)


def local_vocab_index(ids: torch.Tensor, rows: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """For vocabulary ids (local tensor) and this tp rank's ``rows`` of a vocabulary split over
    ``tp``: ``(index, held)``, the ids as rows of this rank's shard (0 where another rank holds
    them) and the mask of those this rank holds. Megatron's vocab-parallel embedding and cross
    entropy both look up their ids this way."""
    start = mesh.get_local_rank("tp") * rows
    held = (ids >= start) & (ids < start + rows)
    return torch.where(held, ids - start, torch.zeros_like(ids)), held


def embedding_lookup(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[tokens]``; a table split over ``tp`` along the vocabulary is looked up Megatron's way
    (``VocabParallelEmbedding``: each rank looks up the ids it holds, zeros elsewhere, and the
    result is a ``Partial`` sum over ``tp``). Its gradient is declared ``Partial`` over the
    data-parallel dims, where each rank saw only its slice of the batch."""
    if not (isinstance(table, DTensor) and "tp" in table.device_mesh.mesh_dim_names):
        return torch.nn.functional.embedding(tokens, table)
    mesh = table.device_mesh
    names = list(mesh.mesh_dim_names)
    if table.placements[names.index("tp")] != Shard(0):
        return torch.nn.functional.embedding(tokens, table)

    def lookup(tok: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        index, held = local_vocab_index(tok, weight.shape[0], mesh)
        out = torch.nn.functional.embedding(index, weight)
        return out * held.unsqueeze(-1).to(out.dtype)

    token_placements = list(tokens.placements)
    out_placements = [Partial() if name == "tp" else p for name, p in zip(names, token_placements)]
    grad_placements = [Partial() if isinstance(tp, Shard) else p
                       for tp, p in zip(token_placements, table.placements)]
    mapped = local_map(lookup, out_placements=out_placements, in_placements=(token_placements, list(table.placements)),
                       in_grad_placements=(token_placements, grad_placements), device_mesh=mesh)
    return mapped(tokens, table)


def is_vocab_parallel(logits: torch.Tensor) -> bool:
    """Whether ``logits`` are a DTensor split over ``tp`` along the vocabulary (the last dim): their
    cross entropy then runs on the shards (``lmfunc.loss.vocab_parallel``)."""
    if isinstance(logits, DTensor) and "tp" in logits.device_mesh.mesh_dim_names:
        tp = logits.placements[list(logits.device_mesh.mesh_dim_names).index("tp")]
        return isinstance(tp, Shard) and tp.dim in (-1, logits.dim() - 1)
    return False
