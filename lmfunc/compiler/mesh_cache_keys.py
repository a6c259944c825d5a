"""Compile-cache keys of graphs that take a ``DeviceMesh``, equal in every process.

A compiled DTensor program (a pipeline stage beside data or tensor parallelism) takes its
``DeviceMesh`` among the graph's inputs, as an opaque object. torch 2.13's FX graph cache and
AOTAutograd's cache pickle that object's state into their keys, and the state holds the mesh's
cached ``_hash``: Python's hash of a tuple of strings, which differs in every process (string
hashing is randomised unless ``PYTHONHASHSEED`` is fixed), and the id of the thread that made it.
So every process computed a key of its own for the same graph, and a restarted run compiled its
stages again instead of loading them. While ``stable_mesh_cache_keys`` holds, the caches' picklers
reduce a ``DeviceMesh`` to its state without those two fields: everything that says which mesh it
is (its ranks, layout, dim names, device type, process groups) stays in the key.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator
from unittest import mock

PROCESS_SPECIFIC = ("_hash", "_thread_id")
"""The fields of a ``DeviceMesh``'s state that differ between processes for the same mesh."""


def _reduce_mesh(mesh) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A mesh as the cache key pickles it: its class and its state less ``PROCESS_SPECIFIC``."""
    from lmfunc.compiler.torch_compat.inductor import codecache_ident

    state = {name: value for name, value in mesh.__getstate__().items() if name not in PROCESS_SPECIFIC}
    return codecache_ident, (type(mesh).__qualname__, state)


@contextlib.contextmanager
def stable_mesh_cache_keys() -> Iterator[None]:
    """While inside: the FX graph cache's pickler (and AOTAutograd's, its subclass) reduce every
    ``DeviceMesh`` with ``_reduce_mesh``."""
    from lmfunc.compiler.torch_compat.inductor import FxGraphCachePickler
    from torch.distributed.device_mesh import DeviceMesh

    original = FxGraphCachePickler.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.dispatch_table[DeviceMesh] = _reduce_mesh

    with mock.patch.object(FxGraphCachePickler, "__init__", init):
        yield
