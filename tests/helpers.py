"""Shared test data and probes."""

import contextlib
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


_POISONED: list[int] = []


def _poisoned_empty_strided_cpu(size, stride, dtype):
    """Inductor's CPU buffer allocation with floating-point buffers filled with NaN (counted)."""
    buffer = _ALLOCATE[0](size, stride, dtype)
    if dtype.is_floating_point:
        buffer.fill_(float("nan"))
        _POISONED.append(buffer.numel())
    return buffer


_ALLOCATE: list[Callable] = []


@contextlib.contextmanager
def poisoned_memory():
    """Every tensor allocated without initialising it starts as NaN, so code that reads memory it
    never wrote gives NaN on every CPU instead of whatever the allocator happened to return.

    Covers Inductor's buffers (its generated code allocates through
    ``torch._C._dynamo.guards._empty_strided_cpu``, looked up when the code is loaded: compile
    inside this context; buffer reuse is off, so no buffer carries an earlier value) and eager
    ``torch.empty``-style allocations (``torch.utils.deterministic.fill_uninitialized_memory``).
    Yields a list that counts the poisoned Inductor buffers, so a test can check that the poison
    reached the compiled code.
    """
    import torch._C._dynamo.guards as guards
    import torch._inductor.config as inductor_config

    if not _ALLOCATE:
        _ALLOCATE.append(guards._empty_strided_cpu)
    _POISONED.clear()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    guards._empty_strided_cpu = _poisoned_empty_strided_cpu
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with inductor_config.patch(allow_buffer_reuse=False, inplace_buffers=False):
            yield _POISONED
    finally:
        guards._empty_strided_cpu = _ALLOCATE[0]
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
