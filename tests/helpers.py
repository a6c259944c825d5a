"""Shared test data and probes."""

from typing import Callable

import torch


def lm_batch(vocab: int, microbatches: int, batch: int, seq: int, seed: int = 0) -> dict:
    """A random token batch ``[M, B, S]`` with labels shifted by one and a partial loss mask."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (microbatches, batch, seq + 1), generator=g)
    mask = (torch.rand(microbatches, batch, seq, generator=g) > 0.2).float()
    return {"tokens": stream[..., :-1], "labels": stream[..., 1:], "loss_mask": mask}


def traced_instructions(call: Callable[[], object]) -> int:
    """How many bytecode instructions Dynamo traces while ``call()`` runs (counted through
    Dynamo's per-instruction ``InstructionTranslatorBase.step``, a private method)."""
    from torch._dynamo import symbolic_convert

    traced = symbolic_convert.InstructionTranslatorBase.step
    count = 0

    def counting_step(self):
        nonlocal count
        count += 1
        return traced(self)

    symbolic_convert.InstructionTranslatorBase.step = counting_step
    try:
        call()
    finally:
        symbolic_convert.InstructionTranslatorBase.step = traced
    return count
