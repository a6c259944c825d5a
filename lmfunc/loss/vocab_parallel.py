"""Cross entropy over logits whose vocabulary is split over ``tp``, forward and backward on the split.

Megatron's ``_VocabParallelCrossEntropy``: each tp rank holds ``V / tp`` of every token's logits;
the loss needs only three numbers per token from the other ranks (the maximum logit, the sum of
exponentials, the target's logit), and the gradient, ``softmax - one_hot``, is computed on each
rank's own shard. Here the same is written with DTensor ops whose placements carry it: a
reduction over the split vocabulary is a ``Partial`` that DTensor all-reduces where it is used,
and the target's logit is picked by ``local_map`` on the shard that holds it (zeros elsewhere, a
``Partial`` sum). Autograd differentiates through those ops, so the backward stays on the shards
too.

torch's ``loss_parallel()`` context does the forward alike, but its backward handlers act only
while the context is active when the backward runs, and they are unsafe for a whole backward (its
log-softmax backward passes the incoming gradient through unchanged, so any other log-softmax in
the same backward would get a wrong gradient). A backward outside the context falls back to
DTensor's default rules, which replicate the logits' gradient, all-gathering ``[tokens, V]`` on
every tp rank, and multiply it by the whole output weight.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from lmfunc.parallel.placement import local_vocab_index

CLASS_DIM = 1
"""The vocabulary dim of the logits: ``[N, V]`` or ``[B, V, S]``, as ``F.cross_entropy`` takes them."""


def _label_placements(logits: DTensor) -> list:
    """The labels' placements for ``logits``': the vocabulary split replaced by ``Replicate``, and a
    split of a later dim moved one down (the labels lack the vocabulary dim)."""
    placements = []
    for p in logits.placements:
        if isinstance(p, Shard) and p.dim == CLASS_DIM:
            placements.append(Replicate())
        elif isinstance(p, Shard) and p.dim > CLASS_DIM:
            placements.append(Shard(p.dim - 1))
        else:
            placements.append(p)
    return placements


def _target_logits(logits: DTensor, labels: torch.Tensor) -> DTensor:
    """``logits[..., labels, ...]`` along the vocabulary, in the labels' placements: each tp rank picks
    the labels in its own range of the vocabulary and zeros for the rest, and the ``Partial`` sum
    over tp is all-reduced."""
    mesh = logits.device_mesh
    names = list(mesh.mesh_dim_names)
    label_placements = _label_placements(logits)

    def pick(local_logits: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
        index, held = local_vocab_index(local_labels, local_logits.shape[CLASS_DIM], mesh)
        return local_logits.gather(CLASS_DIM, index.unsqueeze(CLASS_DIM)).squeeze(CLASS_DIM) * held.to(local_logits.dtype)

    out_placements = [Partial() if name == "tp" else p for name, p in zip(names, label_placements)]
    mapped = local_map(pick, out_placements=out_placements, in_placements=(list(logits.placements), label_placements),
                       in_grad_placements=(list(logits.placements), label_placements), device_mesh=mesh)
    if not isinstance(labels, DTensor):
        labels = DTensor.from_local(labels, mesh, label_placements, run_check=False)
    return mapped(logits, labels).redistribute(mesh, label_placements)


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy (no reduction) of ``logits`` ``[N, V]`` or ``[B, V, S]``, a DTensor
    split over ``tp`` along the vocabulary (dim 1), against ``labels`` ``[N]`` or ``[B, S]``:
    ``logsumexp(logits) - logits[label]``, with the maximum subtracted before the exponentials as
    ``log_softmax`` does. Neither the loss nor its gradient gathers the vocabulary."""
    mesh, per_token = logits.device_mesh, _label_placements(logits)
    # Each reduction over the vocabulary is made whole (all-reduced) once, explicitly: an op that
    # took the partial sum itself would save it and all-reduce it again in the backward.
    peak = logits.detach().amax(dim=CLASS_DIM).redistribute(mesh, per_token)
    sum_exp = (logits - peak.unsqueeze(CLASS_DIM)).exp().sum(dim=CLASS_DIM).redistribute(mesh, per_token)
    return sum_exp.log() + peak - _target_logits(logits, labels)
