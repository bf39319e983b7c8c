"""Per-rank streaming reader: feature Parquet → TorchRec `Batch`es.

The dataset is the row groups of the given files, in file order or (with a seed) in a
shuffled order that changes every epoch. Rank r of W takes the global rows
[r·N/W, (r+1)·N/W) of that order, so ranks are disjoint, together cover the epoch exactly
once, and differ by at most one row. Only the row groups that overlap a rank's range are
read by it (a boundary row group is read by both neighbours, each for its own rows).

Every rank yields the same number of batches, so collectives never hang:
- training (`drop_remainder=True`): ⌊⌊N/W⌋ / B⌋ full batches; the remainder of the epoch,
  fewer than W·(B+1) rows, is not trained on (a shuffled next epoch sees other rows last);
- evaluation (`drop_remainder=False`): ⌈⌈N/W⌉ / B⌉ batches, the last ones padded to B rows
  with label −1, which evaluation discards.

A background thread reads and decodes ahead into a bounded queue (`prefetch` batches).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ingestion.schema import DENSE_COLUMNS, SPARSE_COLUMNS

PAD_LABEL = -1.0


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of one row group of one file."""

    path: str
    row_group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def list_row_groups(paths: Sequence[Path | str]) -> list[tuple[str, int, int]]:
    """(file, row group, rows) for every row group, from Parquet footers only."""
    groups = []
    for path in paths:
        metadata = pq.ParquetFile(path).metadata
        groups += [(str(path), g, metadata.row_group(g).num_rows) for g in range(metadata.num_row_groups)]
    return groups


def rank_segments(
    groups: Sequence[tuple[str, int, int]], rank: int, world_size: int, order_seed: Sequence[int] | None = None
) -> list[Segment]:
    """The segments holding rank `rank`'s share of the global row order."""
    order = list(groups)
    if order_seed is not None:
        permutation = np.random.default_rng(order_seed).permutation(len(order))
        order = [order[i] for i in permutation]
    total = sum(rows for _, _, rows in order)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    segments, offset = [], 0
    for path, group, rows in order:
        start, stop = max(lo, offset), min(hi, offset + rows)
        if start < stop:
            segments.append(Segment(path, group, start - offset, stop - offset))
        offset += rows
    return segments


class BatchReader:
    """Iterable of `Batch`es for one rank; `len()` is the same on every rank."""

    def __init__(
        self,
        paths: Sequence[Path | str],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        shuffle_seed: int | None = None,
        epoch: int = 0,
        drop_remainder: bool = True,
        start_batch: int = 0,
        prefetch: int = 4,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.batch_size, self.drop_remainder, self.prefetch = batch_size, drop_remainder, prefetch
        self.shuffle_seed, self.epoch = shuffle_seed, epoch
        groups = list_row_groups(paths)
        total = sum(rows for _, _, rows in groups)
        order_seed = None if shuffle_seed is None else [shuffle_seed, epoch]
        self.segments = rank_segments(groups, rank, world_size, order_seed)
        self.rank_rows = sum(s.rows for s in self.segments)
        if drop_remainder:
            self.num_batches = (total // world_size) // batch_size
        else:
            self.num_batches = math.ceil(math.ceil(total / world_size) / batch_size)
        self.start_batch = min(start_batch, self.num_batches)

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[Batch]:
        return _prefetched(self._batches(), self.prefetch)

    def _batches(self) -> Iterator[Batch]:
        emitted = self.start_batch
        rows = _RowBuffer()
        for dense, sparse, labels in self._rows_from(self.start_batch * self.batch_size):
            rows.append(dense, sparse, labels)
            while len(rows) >= self.batch_size and emitted < self.num_batches:
                yield _to_batch(*rows.take(self.batch_size))
                emitted += 1
        while emitted < self.num_batches:  # evaluation only: pad the tail to full batches
            dense, sparse, labels = rows.take(len(rows))
            yield _to_batch(*_pad(dense, sparse, labels, self.batch_size))
            emitted += 1

    def _rows_from(self, skip: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Decoded segments in order, starting `skip` rows into this rank's stream."""
        for index, segment in enumerate(self.segments):
            if skip >= segment.rows:
                skip -= segment.rows
                continue
            dense, sparse, labels = _read_segment(segment)
            if self.shuffle_seed is not None:
                # in-memory shuffle of one row group; seeded so a resumed run replays it
                rng = np.random.default_rng([self.shuffle_seed, self.epoch, index])
                permutation = rng.permutation(len(labels))
                dense, sparse, labels = dense[permutation], sparse[permutation], labels[permutation]
            yield dense[skip:], sparse[skip:], labels[skip:]
            skip = 0


def build_reader(
    paths: Sequence[Path | str], batch_size: int, rank: int = 0, world_size: int = 1, **options
) -> BatchReader:
    """The reader for one rank; see `BatchReader` for options."""
    return BatchReader(paths, batch_size, rank, world_size, **options)


def _read_segment(segment: Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = pq.ParquetFile(segment.path).read_row_group(segment.row_group)
    table = table.slice(segment.start, segment.rows)
    dense = np.column_stack([table[c].to_numpy() for c in DENSE_COLUMNS]).astype(np.float32, copy=False)
    sparse = np.column_stack([table[c].to_numpy() for c in SPARSE_COLUMNS]).astype(np.int64, copy=False)
    labels = table["label"].to_numpy().astype(np.float32)
    return dense, sparse, labels


class _RowBuffer:
    """Decoded rows waiting to be cut into batches."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def append(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        if len(labels):
            self.parts.append((dense, sparse, labels))
            self.rows += len(labels)

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self.parts) > 1:
            self.parts = [tuple(np.concatenate(cols) for cols in zip(*self.parts))]  # type: ignore[misc]
        if not self.parts:
            return np.zeros((0, len(DENSE_COLUMNS)), np.float32), np.zeros((0, len(SPARSE_COLUMNS)), np.int64), np.zeros(0, np.float32)
        dense, sparse, labels = self.parts[0]
        self.parts = [(dense[n:], sparse[n:], labels[n:])] if n < len(labels) else []
        self.rows -= min(n, len(labels))
        return dense[:n], sparse[:n], labels[:n]


def _pad(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray, size: int):
    missing = size - len(labels)
    return (
        np.concatenate([dense, np.zeros((missing, dense.shape[1]), np.float32)]),
        np.concatenate([sparse, np.zeros((missing, sparse.shape[1]), np.int64)]),
        np.concatenate([labels, np.full(missing, PAD_LABEL, np.float32)]),
    )


def _to_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
    """[B, 13] floats, [B, 26] ids, [B] labels → a TorchRec Batch (one id per feature)."""
    batch_size = len(labels)
    values = torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1))  # feature-major
    kjt = KeyedJaggedTensor(
        keys=list(SPARSE_COLUMNS),
        values=values,
        lengths=torch.ones(len(SPARSE_COLUMNS) * batch_size, dtype=torch.int32),
        stride=batch_size,
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
    )


_DONE = object()


def _prefetched(source: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """Run `source` in a background thread, at most `depth` items ahead of the consumer."""
    if depth <= 0:
        yield from source
        return
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put(_DONE)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            items.put(error)

    worker = threading.Thread(target=produce, name="batch-prefetch", daemon=True)
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
