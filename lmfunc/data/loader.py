"""A background prefetching loader: batches are built on a thread while the step runs.

The batches of a run are known in advance (the sample range of step ``i`` follows from the batch
plan), so the loader is just an ordered producer over ``make_batch(job)`` for each job, ``depth``
batches ahead. Errors on the thread are re-raised in the consumer; ``close()`` stops it early.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

_DONE = object()


class PrefetchLoader:
    """Iterate ``make_batch(job)`` for ``job`` in ``jobs``, computed ``depth`` batches ahead on a thread."""

    def __init__(self, make_batch: Callable[[Any], Any], jobs: Iterable[Any], depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(make_batch, iter(jobs)), daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, make_batch: Callable[[Any], Any], jobs: Iterator[Any]) -> None:
        try:
            for job in jobs:
                if not self._put(make_batch(job)):
                    return
            self._put(_DONE)
        except BaseException as err:  # handed to the consumer, which re-raises it
            self._put(err)

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop producing (pending batches are dropped)."""
        self._stop.set()
        self._thread.join(timeout=5)
