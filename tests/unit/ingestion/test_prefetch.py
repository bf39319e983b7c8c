import threading
import time

import pytest

from ingestion.prefetch import prefetched


def test_items_arrive_in_order_then_the_producers_error() -> None:
    def source():
        yield from range(5)
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for item in prefetched(source(), depth=2):
            seen.append(item)  # noqa: PERF402 - list() would drop the items read before the error
    assert seen == [0, 1, 2, 3, 4]


def test_the_producer_stays_at_most_depth_items_ahead_and_stops_when_closed() -> None:
    produced = []

    def source():
        for i in range(1000):
            produced.append(i)
            yield i

    items = prefetched(source(), depth=3, name="test-prefetch")
    assert next(items) == 0
    time.sleep(0.3)
    # one handed over, `depth` queued, one more waiting to be queued
    assert len(produced) <= 1 + 3 + 1
    items.close()
    time.sleep(0.3)
    assert len(produced) <= 1 + 3 + 1
    assert not any(t.name == "test-prefetch" and t.is_alive() for t in threading.enumerate())
