"""A stretch of work on a set number of the process's intra-op threads, given back after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads at `count` until the block ends, then what they were: a stage
    that runs inside a longer-lived process (a flow in a test process, a served command) must
    not leave its own choice behind for everything that runs after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
