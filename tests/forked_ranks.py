"""Ranks for the unit tests that start gloo processes of their own: forked from a forkserver
that imported torch, TorchRec, fbgemm and the trainer once (one per test process), in place
of `mp.spawn`'s new interpreters, which import them again for every rank (about 3 s of CPU
each on 2 cores).

A rank still starts as a spawned one does: a fresh process whose function and arguments come
pickled, with the test process's `sys.path` and working folder; only the imports are done
already. What a rank needs from the environment it sets itself (MASTER_ADDR, MASTER_PORT):
the forkserver's environment is the test process's as it was at the first call.

A rank that returned leaves as the trainer's workers do (`training.worker.exit_skipping_teardown`):
gloo's threads outlive `destroy_process_group`, and the interpreter's teardown rarely stopped
them with SIGABRT ("terminate called without an active exception") after the rank had done
its work and stored its results.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

_PRELOADED = ["torch", "torch.distributed", "fbgemm_gpu", "torchrec", "training.worker"]


def start_ranks(function: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """`function(rank, *args)` in `nprocs` processes; returns once all have ended, and raises
    as `mp.spawn` does when one fails."""
    multiprocessing.set_forkserver_preload(_PRELOADED)  # read when the forkserver starts: the first call
    mp.start_processes(_rank_then_leave, args=(function, *args), nprocs=nprocs, join=True, start_method="forkserver")


def as_one_host_rank(rank: int, world: int, port: int) -> None:
    """This process's environment as torchrun gives it to rank `rank` of a one-host job of
    `world` processes: what the trainer's code reads (the sharding plan and the batches read
    LOCAL_WORLD_SIZE) and gloo's rendezvous for `init_process_group("gloo")`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip


def _rank_then_leave(rank: int, function: Callable[..., None], *args: Any) -> None:
    # an exception propagates to the start method's wrapper, which reports it and exits 1
    function(rank, *args)
    from training.worker import exit_skipping_teardown

    exit_skipping_teardown()
