"""Run an iterator in a background thread, a bounded number of items ahead of its consumer.

Used wherever the producer spends its time in code that releases the GIL (zlib, Arrow,
Parquet decoding), so that a second core works while the consumer does.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def prefetched(source: Iterator[T], depth: int, name: str = "prefetch") -> Iterator[T]:
    """Yield `source`'s items, produced in a thread at most `depth` items ahead.

    An exception raised by `source` is raised in the consumer, after the items produced
    before it. Closing the consumer early stops the producer at its next item.
    """
    if depth <= 0:
        yield from source
        return
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(item: object) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not hand_over(item):
                    return
            hand_over(_DONE)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            hand_over(error)

    worker = threading.Thread(target=produce, name=name, daemon=True)
    worker.start()
    try:
        while True:
            item = items.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
