"""Shared test data."""

import torch


def lm_batch(vocab: int, microbatches: int, batch: int, seq: int, seed: int = 0) -> dict:
    """A random token batch ``[M, B, S]`` with labels shifted by one and a partial loss mask."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (microbatches, batch, seq + 1), generator=g)
    mask = (torch.rand(microbatches, batch, seq, generator=g) > 0.2).float()
    return {"tokens": stream[..., :-1], "labels": stream[..., 1:], "loss_mask": mask}
