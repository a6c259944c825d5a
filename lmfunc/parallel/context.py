"""Context parallelism: each sequence split over the ``cp`` mesh dim, balanced for causal attention.

Megatron's load balancing cuts a sequence into ``2 * cp`` equal chunks and gives rank ``r`` chunks
``r`` and ``2 * cp - 1 - r``: every rank holds one early and one late chunk, so every rank's
queries see about the same number of earlier keys. lmfunc puts each sequence in that order once,
along its last dim (``load_balanced_order``). A plain ``Shard`` of the sequence dim over ``cp``
then hands each rank its two chunks, and whatever is indexed by token (ids, positions, document
ids, labels, the loss mask) travels with its token.

Attention gathers the keys and values over ``cp`` (the Llama 3 approach: with GQA only the kv heads
travel) and masks each query against the gathered keys by the tokens' original indices and
document ids (``attend_gathered``). In ``context_parallel_attention`` the gather is a DTensor
redistribute and the local kernel runs under ``local_map``, whose gradient placements declare the
gathered keys' and values' gradients ``Partial`` over ``cp``: the gather's backward is then a
reduce-scatter, with no collective written by hand.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

CP_DIM = "cp"


def load_balanced_order(seq_len: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The original indices ``[S]`` of a sequence of ``seq_len`` tokens in the order the ``cp``
    ranks hold them: rank ``r``'s contiguous ``seq_len / cp`` slice is chunks ``r`` and
    ``2 * cp - 1 - r`` of ``2 * cp`` equal chunks. The identity for ``cp == 1``."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split into 2 x cp = {2 * cp} equal chunks for "
                         f"context parallelism; make data.seq_length a multiple of {2 * cp}")
    chunks = torch.arange(seq_len, device=device).view(2 * cp, seq_len // (2 * cp))
    ranks = [torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)]
    return torch.cat(ranks)


def contiguous_order(seq_len: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The naive split for comparison: rank ``r`` holds the ``r``-th ``seq_len / cp`` tokens."""
    if cp < 1 or seq_len % cp:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split into cp = {cp} equal parts")
    return torch.arange(seq_len, device=device)


def to_order(x: torch.Tensor, order: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` with its ``dim`` (the sequence) rearranged into ``order`` (``load_balanced_order``)."""
    return x.index_select(dim, order.to(x.device))


def from_order(x: torch.Tensor, order: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The inverse of ``to_order``: ``x``'s ``dim`` back in the original token order."""
    return x.index_select(dim, torch.argsort(order).to(x.device))


def _rank_order(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The original indices ``[S / cp]`` of the tokens rank ``rank`` holds (``load_balanced_order``)."""
    part = seq_len // cp
    return load_balanced_order(seq_len, cp, device)[rank * part:(rank + 1) * part]


def context_part(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of whole sequences ``x`` ``[..., S]``: its two load-balanced chunks
    ``[..., S / cp]``, in that order."""
    return to_order(x, _rank_order(x.shape[-1], cp, rank))


def roll_left(x: DTensor) -> DTensor:
    """``x`` ``[..., S]`` (split over ``cp`` in load-balanced order) shifted one token left in the
    original order, the last token's value 0: what MTP does to its tokens, labels and mask. A token
    whose neighbour lives on another rank needs that rank's value, so the sequence is gathered over
    ``cp`` (integers and masks, no gradient), rolled, and each rank keeps its part again."""
    mesh = x.device_mesh
    whole = x.redistribute(mesh, _on_cp(x, Replicate()))
    local = whole.to_local()
    order = load_balanced_order(local.shape[-1], mesh.size(list(mesh.mesh_dim_names).index(CP_DIM)),
                                device=local.device)
    natural = from_order(local, order)
    rolled = torch.cat([natural[..., 1:], torch.zeros_like(natural[..., :1])], dim=-1)
    back = DTensor.from_local(to_order(rolled, order), mesh, whole.placements, run_check=False)
    return back.redistribute(mesh, x.placements)


def is_context_parallel(x: torch.Tensor) -> bool:
    """Whether ``x`` is a DTensor on a mesh with a ``cp`` dim (its sequence then split over it)."""
    return isinstance(x, DTensor) and CP_DIM in (x.device_mesh.mesh_dim_names or ())


def token_index(tokens: DTensor) -> DTensor:
    """The original index of every token of ``tokens`` ``[B, S]`` (split over ``cp`` in load-balanced
    order): ``load_balanced_order`` as a DTensor ``[S]`` split over ``cp`` like the tokens and
    replicated over the other dims. Each rank makes its own part; nothing is communicated. It is
    also the tokens' default positions."""
    mesh = tokens.device_mesh
    names = list(mesh.mesh_dim_names)
    cp, rank = mesh.size(names.index(CP_DIM)), mesh.get_local_rank(CP_DIM)
    order = _rank_order(tokens.shape[-1], cp, rank, tokens.to_local().device)
    placements = [Shard(0) if name == CP_DIM else Replicate() for name in names]
    return DTensor.from_local(order, mesh, placements, run_check=False)


class ContextMask(NamedTuple):
    """What attention masks with when the sequence is split over ``cp`` (``context_mask``): the
    original index of this rank's tokens ``[S]`` and of all tokens ``[S]`` (gathered over ``cp``),
    and for document masking their document ids ``[B, S]`` likewise (None: causal only), all in
    load-balanced order. Gathered once per forward, used by every layer."""

    query_index: torch.Tensor
    key_index: torch.Tensor
    query_docs: Optional[torch.Tensor]
    key_docs: Optional[torch.Tensor]


def context_mask(index: DTensor, doc_ids: Optional[DTensor]) -> ContextMask:
    """The ``ContextMask`` of tokens with original indices ``index`` (``token_index``) and document
    ids ``doc_ids`` ``[B, S]`` (or None), both split over ``cp``."""
    mesh = index.device_mesh
    key_docs = None if doc_ids is None else doc_ids.redistribute(mesh, _on_cp(doc_ids, Replicate()))
    # every rank knows the whole order: made here, not gathered
    cp = mesh.size(list(mesh.mesh_dim_names).index(CP_DIM))
    whole = load_balanced_order(index.shape[0], cp, index.to_local().device)
    key_index = DTensor.from_local(whole, mesh, _on_cp(index, Replicate()), run_check=False)
    return ContextMask(index, key_index, doc_ids, key_docs)


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_index: torch.Tensor,
                    key_index: torch.Tensor, query_docs: Optional[torch.Tensor],
                    key_docs: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention of one rank's queries ``q`` ``[B, a, Sq, d]`` over all keys/values ``k, v``
    ``[B, g, Sk, d]``: query ``i`` sees key ``j`` when ``key_index[j] <= query_index[i]`` (causal in
    the original order) and, with document ids ``[B, Sq]``/``[B, Sk]``, when both are in the same
    document. A query always sees itself, so no row is empty. Returns ``[B, a, Sq, d]``."""
    mask = (query_index[:, None] >= key_index[None, :])[None, None]
    if query_docs is not None:
        mask = mask & (query_docs[:, :, None] == key_docs[:, None, :])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _on_cp(x: DTensor, placement: Placement) -> list[Placement]:
    return [placement if name == CP_DIM else p for name, p in zip(x.device_mesh.mesh_dim_names, x.placements)]


def context_parallel_attention(q: DTensor, k: DTensor, v: DTensor, mask: ContextMask) -> DTensor:
    """Causal (and document-masked) attention of ``q`` ``[B, a, S, d]`` and ``k, v`` ``[B, g, S, d]``,
    DTensors whose sequence dim is split over ``cp`` in load-balanced order, masked by ``mask``
    (``context_mask``). Keys and values are all-gathered over ``cp``; each rank attends its own
    queries (``attend_gathered``); the keys' and values' gradients come back as ``Partial`` sums
    over ``cp``, which the gather's backward reduce-scatters. The output is placed like ``q``."""
    mesh: DeviceMesh = q.device_mesh
    # gathered as [B, S, g, d], the layout the projection made them in: the reduce-scatter's
    # gradient then comes back in that layout, which the projection's backward can view as [B, S, g * d]
    gathered = [t.redistribute(mesh, _on_cp(t, Replicate())) for t in (k.transpose(1, 2), v.transpose(1, 2))]
    args = (q, *gathered, *mask)
    in_placements = tuple(None if a is None else list(a.placements) for a in args)
    grad_placements = (list(q.placements), *(_on_cp(g, Partial()) for g in gathered), *in_placements[3:])
    mapped = local_map(_attend_gathered_bsgd, out_placements=list(q.placements), in_placements=in_placements,
                       in_grad_placements=grad_placements, device_mesh=mesh)
    return mapped(*args)


def _attend_gathered_bsgd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: Optional[torch.Tensor]):
    """``attend_gathered`` with keys and values ``[B, Sk, g, d]``."""
    return attend_gathered(q, k.transpose(1, 2), v.transpose(1, 2), *mask)


def causal_pairs_per_rank(order: torch.Tensor, cp: int, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How many (query, key) pairs each of the ``cp`` ranks' queries attend when the sequence is
    held in ``order`` (``[S]`` original indices; rank ``r`` holds the ``r``-th slice): the causal
    pairs, restricted to one document by ``doc_ids`` ``[S]`` (original order) when given. The
    attention FLOPs a kernel that skips masked blocks spends on each rank are proportional."""
    seq = order.numel()
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    if doc_ids is not None:
        allowed &= doc_ids[:, None] == doc_ids[None, :]
    per_query = allowed.sum(dim=1)[order]
    return per_query.view(cp, seq // cp).sum(dim=1)


def attention_flops_per_rank(order: torch.Tensor, cp: int, num_heads: int, head_dim: int, batch: int = 1,
                             doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward attention FLOPs per rank ``[cp]``: ``2 * 2 * a * d`` per attended (query, key) pair
    (the scores ``Q K^T`` and the weighted values ``P V``, a multiply and an add each), times the
    batch."""
    return 4 * num_heads * head_dim * batch * causal_pairs_per_rank(order, cp, doc_ids)
