"""Two gloo processes, each scoring half of the examples, agree with one process on all of them."""

import os

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import start_ranks
from ports import free_port

from evaluation.distributed import all_reduce_state
from evaluation.metrics import binary_state, compute_calibration, compute_log_loss, compute_ne


def _examples():
    rng = np.random.default_rng(42)
    p = rng.uniform(0.001, 0.999, 10_001)  # odd count: the halves differ in size
    y = (rng.random(p.size) < p).astype(np.float64)
    w = rng.uniform(0.5, 2.0, p.size)
    return y, p, w


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        y, p, w = _examples()
        part = np.array_split(np.arange(y.size), world)[rank]
        results[rank] = all_reduce_state(binary_state(y[part], p[part], w[part])).as_array()
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_equal_one() -> None:
    results = mp.Manager().dict()
    start_ranks(_worker, (2, free_port(), results), 2)
    y, p, w = _examples()
    single = binary_state(y, p, w)
    from evaluation.metrics import BinaryState

    for rank in (0, 1):
        reduced = BinaryState.from_array(np.array(results[rank]))
        assert compute_ne(reduced) == pytest.approx(compute_ne(single), rel=1e-12)
        assert compute_log_loss(reduced) == pytest.approx(compute_log_loss(single), rel=1e-12)
        assert compute_calibration(reduced) == pytest.approx(compute_calibration(single), rel=1e-12)
