"""The one place lmfunc touches torch's private API (``torch._*``, ``torch.utils._*`` and other
underscored modules), with a branch for each supported torch minor where they differ.

Each submodule holds one part of torch. A name is looked up in torch the first time it is
used (``lazy_names``), so importing lmfunc loads no torch module it does not need, and a name that a
torch release moved fails where it is used, naming the entry, not at ``import lmfunc``. Every entry
says why lmfunc needs it and which public API would replace it; ``tests/test_torch_compat.py``
resolves every entry on the installed torch and fails on a private use anywhere else in lmfunc.

- ``tensors``: what the model, the optimizer and the pytrees use at run time (pytrees, foreach
  ops, the grouped matmul, ``scan``, functional collectives, operator classes).
- ``tracing``: Dynamo, AOTAutograd and fake tensors.
- ``inductor``: Inductor's passes, settings, caches and C++ builds.
- ``scheduling``: Inductor's buffer and memory planning, which the dry run reads.
- ``distributed``: private parts of ``torch.distributed`` (process groups, DTensor caches,
  pipelining).

This package imports nothing of lmfunc, so every layer may import it.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, NamedTuple

import torch

SUPPORTED_TORCH = ((2, 11), (2, 15))
"""The oldest and the newest torch minor lmfunc supports (pyproject.toml's range)."""


def _minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"lmfunc: cannot read torch's version {version!r}")
    return int(match.group(1)), int(match.group(2))


TORCH_MINOR = _minor(torch.__version__)
"""The installed torch's (major, minor)."""


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer."""
    return TORCH_MINOR >= (major, minor)


class TorchTooOld(RuntimeError):
    """What lmfunc raises where the installed torch cannot do what was asked: one line that names
    the torch that can."""


def too_old_message(major: int, minor: int, what: str) -> str:
    """One line: ``what`` needs torch ``major.minor`` or newer, this torch, and how to get one."""
    return (f"{what} needs torch >= {major}.{minor}; this is torch {torch.__version__} "
            f"(pip install 'torch>={major}.{minor},<{SUPPORTED_TORCH[1][0]}.{SUPPORTED_TORCH[1][1] + 1}')")


def require_torch(major: int, minor: int, what: str) -> None:
    """Raise ``TorchTooOld`` unless the installed torch is ``major.minor`` or newer; ``what`` names
    what needs it (``"a compiled step on a DTensor mesh"``)."""
    if not torch_at_least(major, minor):
        raise TorchTooOld(too_old_message(major, minor, what))


class Private(NamedTuple):
    """One private torch name lmfunc uses. ``path``: ``"module"`` or ``"module:attr.attr"``;
    ``why``: what lmfunc needs it for; ``public``: the public API that would replace it (or
    ``"none"``); ``since``: the oldest torch minor that has it (what uses it on an older torch is
    refused before it gets there)."""

    path: str
    why: str
    public: str
    since: tuple[int, int] = (2, 11)


def resolve(path: str) -> Any:
    """The object ``path`` (``"module"`` or ``"module:attr.attr"``) names in the installed torch."""
    module_name, _, attrs = path.partition(":")
    obj = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def lazy_names(module_name: str, entries: dict[str, Private]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves ``entries[name]`` on first use and keeps it in the
    module's namespace; an entry this torch lacks raises an ``ImportError`` naming the entry."""
    import sys

    def __getattr__(name: str) -> Any:
        entry = entries.get(name)
        if entry is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if not torch_at_least(*entry.since):
            raise ImportError(f"lmfunc.compiler.torch_compat: {module_name}.{name} ({entry.why}) needs torch >= "
                              f"{entry.since[0]}.{entry.since[1]}; this is torch {torch.__version__}")
        try:
            value = resolve(entry.path)
        except (ImportError, AttributeError) as e:
            raise ImportError(f"lmfunc.compiler.torch_compat: torch {torch.__version__} has no {entry.path} "
                              f"({module_name}.{name}: {entry.why}): {e}") from e
        setattr(sys.modules[module_name], name, value)
        return value

    return __getattr__
