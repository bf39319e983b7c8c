"""This rank's training batches, read in order from a position, with what the row ledger
and the checkpoint position need to know of each."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from ingestion.prefetch import prefetched
from ingestion.reader import BatchReader, build_reader
from training.config import TrainingConfig
from training.job import TrainJob
from training.loop.checkpoint import TrainPosition


def reader_prefetch(config: TrainingConfig) -> int:
    """Batches to decode ahead in a background thread: only when a core is free for it.

    Measured on 2 cores with 2 compute threads: a reader thread beside them cut training
    throughput from 38.8k to 29.8k samples/s; reading in the training thread kept 38.8k.
    """
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", config.nproc))
    spare_cores = (os.cpu_count() or 1) - local_processes * config.threads_per_proc
    return 4 if spare_cores >= 1 else 0


def reader_decode_threads(config: TrainingConfig) -> int:
    """Threads decoding row groups side by side: the cores left after the training processes'
    threads and one reader thread per process, at most 4 per process (an H200 host of 16
    cores, one process: 4; a 2-core host: 1, decoding in the reader thread itself). One
    thread read 2.2 M rows/s on that host, while its GPU trained 10 M samples/s."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", config.nproc))
    spare_cores = (os.cpu_count() or 1) - local_processes * (config.threads_per_proc + 1)
    return max(1, min(4, spare_cores // local_processes))


@dataclass(frozen=True)
class ReadBatch:
    """Where a batch read for training came from, and what the ledger adds for it."""

    epoch: int
    index: int  # within the epoch
    rows: int  # its real rows
    hash_sum: int  # Σ of their hashes (ingestion/reader.row_hashes), mod 2**64


class TrainBatches:
    """This rank's training batches from `start` to the end of the last epoch.

    The sparse-dist pipeline reads up to two batches ahead of the one it trains, and the
    batches train in the order they were read: so the oldest batch read and not yet trained
    (`pop_trained`) is the one a step just trained. The ledger and the checkpoint position
    follow trained batches, never the ones in flight (a resume reads those again).
    """

    def __init__(self, job: TrainJob, device: torch.device, start: TrainPosition) -> None:
        self.job, self.device, self.start = job, device, start
        self.prefetch = reader_prefetch(job.training)
        self.decode_threads = reader_decode_threads(job.training) if self.prefetch else 1
        self.steps_per_epoch = self._reader(0).num_batches
        self._read: deque[ReadBatch] = deque()
        self.last_trained: ReadBatch | None = None
        self.stream = self._batches()

    def pop_trained(self) -> ReadBatch:
        """The batch the step that just ran trained: the oldest one read and not yet trained."""
        self.last_trained = self._read.popleft()
        return self.last_trained

    def position(self, step: int) -> TrainPosition:
        """Where training stands after step `step`, which trained `last_trained`."""
        trained = self.last_trained
        assert trained is not None, "no batch trained yet"
        if trained.index + 1 < self.steps_per_epoch:
            return TrainPosition(step, trained.epoch, trained.index + 1)
        return TrainPosition(step, trained.epoch + 1, 0)

    def close(self) -> None:
        self.stream.close()

    def _reader(self, epoch: int, first_batch: int = 0) -> BatchReader:
        config = self.job.training
        # every row trained: the last batch of an epoch is padded, and padding weighs nothing
        # (training/model/objective.py)
        # read in this class's own thread (`_batches`), with the hashing and pinning
        return build_reader(self.job.train_files, self.job.workers.per_rank_batch(config.batch_size), dist.get_rank(),
                            dist.get_world_size(), shuffle_seed=config.seed, epoch=epoch, start_batch=first_batch,
                            drop_remainder=False, prefetch=0, decode_threads=self.decode_threads,
                            crosses=self.job.crosses, count_bins=self.job.count_bins)  # fmt: skip

    def _batches(self) -> Iterator[Batch]:
        # Reading, the ledger's hashes and page-locking run ahead in one background thread
        # where a core is free for it: the training thread (and a GPU's pipeline) only trains.
        for batch, read in prefetched(self._prepared(), self.prefetch, name="train-batches"):
            self._read.append(read)
            yield batch

    def _prepared(self) -> Iterator[tuple[Batch, ReadBatch]]:
        for epoch in range(self.start.epoch, self.job.most_epochs):
            first = self.start.batch if epoch == self.start.epoch else 0
            for index, (batch, rows, hash_sum) in enumerate(self._reader(epoch, first).with_row_sums(), start=first):
                read = ReadBatch(epoch, index, rows, hash_sum)
                # page-locked, so the copy to the GPU is asynchronous and overlaps the step
                yield (batch.pin_memory() if self.device.type == "cuda" else batch), read
