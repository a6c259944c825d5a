"""Keep Inductor's in-place buffer reuse in a graph that writes into its inputs (torch 2.13).

A graph that writes into one of its inputs (the donating train step writes the new parameters
into the old ones) gives the writing node an ordering-only user (a "weak" user, from a fake
``WeakDep``) on the output of every earlier reader of that input, so that the write runs after
them. Inductor's in-place decision (``BaseSchedulerNode.decide_inplace_update``) lets a kernel
write its result into an input buffer only when no other user of that buffer is still to run,
and it counts these ordering-only users too. So in fp32 compute, where the matmuls read the
parameters themselves, no kernel may write into the output buffer of a matmul: every such kernel
gets a new buffer, which costs the donating step memory and time.

``inplace_reuse_despite_input_writes()`` hides those users from that one decision while Inductor
compiles. They still order the nodes, and buffer lifetimes are decided as before. An ordering-only
user does not read the buffer (a user that also reads it is a normal user), so writing a kernel's
result into that buffer cannot change what the writing node sees. Users whose dependency is not
fake (the reader's output is a view of the written input) are kept.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

from lmfunc.compiler.torch_compat.inductor import WeakDep, scheduler


def _only_orders(user: "scheduler.NodeUser", name: str) -> bool:
    """Whether ``user`` of buffer ``name`` just runs after the buffer's producer (only fake weak
    dependencies on ``name``, nothing read)."""
    if not user.is_weak or not hasattr(user.node, "read_writes"):
        return False
    deps = [dep for dep in user.node.read_writes.reads if dep.name == name]
    return bool(deps) and all(isinstance(dep, WeakDep) and dep.is_fake for dep in deps)


def _ignoring_ordering_users(decide: Callable) -> Callable:
    """``decide_inplace_update`` run with the ordering-only users of the node's inputs hidden."""

    @functools.wraps(decide)
    def decide_inplace_update(self) -> None:
        hidden = []
        for read in self.read_writes.reads:
            buffer = self.scheduler.name_to_buf.get(read.name)
            if buffer is None:
                continue
            users = [user for user in buffer.users if not _only_orders(user, read.name)]
            if len(users) != len(buffer.users):
                hidden.append((buffer, buffer.users))
                buffer.users = users
        try:
            decide(self)
        finally:
            for buffer, users in reversed(hidden):
                buffer.users = users

    return decide_inplace_update


@contextlib.contextmanager
def inplace_reuse_despite_input_writes() -> Iterator[None]:
    """Inside: Inductor's in-place decision ignores users that only order a write into a graph
    input after the buffer's producer (see the module docstring)."""
    node_class = scheduler.BaseSchedulerNode
    original = node_class.decide_inplace_update
    node_class.decide_inplace_update = _ignoring_ordering_users(original)
    try:
        yield
    finally:
        node_class.decide_inplace_update = original
