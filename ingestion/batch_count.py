"""How many batches each rank reads: arithmetic only, so that a run's length is known
(training/loop/run_length.py) without importing the reader's torch and TorchRec."""

from __future__ import annotations

import math


def batches_per_rank(rows: int, batch_size: int, world_size: int, drop_remainder: bool = False) -> int:
    """Batches each rank reads over `rows` rows: the same on every rank. Without
    `drop_remainder` the last ones are padded (a rank holds at most ⌈rows / W⌉ rows), so
    every row is read; with it, a partial batch is left out. The one count of a run's steps
    per epoch (training/loop/run_length.py predicts it from the row count)."""
    if drop_remainder:
        return (rows // world_size) // batch_size
    return math.ceil(math.ceil(rows / world_size) / batch_size)
