import time

import pytest

from lmfunc.data.loader import PrefetchLoader


def test_batches_come_in_order_and_ahead_of_the_consumer():
    built = []

    def make(job):
        built.append(job)
        return job * 10

    loader = PrefetchLoader(make, range(6), depth=2)
    iterator = iter(loader)
    assert next(iterator) == 0
    time.sleep(0.2)
    assert len(built) >= 3  # the producer ran ahead while the consumer was busy
    assert list(iterator) == [10, 20, 30, 40, 50]
    loader.close()


def test_errors_reach_the_consumer_and_close_stops_early():
    def make(job):
        if job == 2:
            raise ValueError("bad sample 2")
        return job

    with pytest.raises(ValueError, match="bad sample 2"):
        list(PrefetchLoader(make, range(5)))
    loader = PrefetchLoader(lambda j: j, range(10**9), depth=1)
    assert next(iter(loader)) == 0
    loader.close()
    assert not loader._thread.is_alive()
