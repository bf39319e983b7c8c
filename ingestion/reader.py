"""Per-rank streaming reader: feature Parquet → TorchRec `Batch`es.

The dataset is the row groups of the given files, in file order or (with a seed) in a
shuffled order that changes every epoch. Rank r of W takes the global rows
[r·N/W, (r+1)·N/W) of that order, so ranks are disjoint, together cover the epoch exactly
once, and differ by at most one row. Only the row groups that overlap a rank's range are
read by it (a boundary row group is read by both neighbours, each for its own rows).

Every rank yields the same number of batches, so collectives never hang:
- `drop_remainder=False` (training and evaluation): ⌈⌈N/W⌉ / B⌉ batches, the last ones
  padded to B rows with label −1, which evaluation discards and the training loss weighs
  at zero (training/model/objective.py): every row is trained and scored once an epoch;
- `drop_remainder=True`: ⌊⌊N/W⌋ / B⌋ full batches; the rest of the epoch is left out.

A background thread reads and decodes ahead into a bounded queue (`prefetch` batches);
with `decode_threads` > 1 the row groups are decoded, hashed and shuffled by that many
threads side by side, and still come out in order (the same batches whatever the count).

`with_row_sums()` also gives, for each batch, the count of its real rows and the sum of
their hashes (`row_hashes`): what the training loop's ledger adds, worked out a row group
at a time as it is decoded, so a batch costs the ledger two reductions.

Multi-hot features (list columns, found in the files' schema) become jagged KJT entries
with one length per example; every other feature has length 1. Padding rows carry id 0.
`crosses` (ingestion/cross_ids.py) add one id column each, computed from two one-id
columns as a row group is decoded, keyed after the files' features; `count_bins`
(ingestion/count_bins.py) one each, the bin of a dense value, keyed after the crosses.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ingestion.batch_count import batches_per_rank
from ingestion.count_bins import CountBins, bin_rows
from ingestion.cross_ids import Cross, cross_rows
from ingestion.prefetch import prefetched
from ingestion.schema import FeatureLayout, feature_layout

T = TypeVar("T")
R = TypeVar("R")

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


def files_layout(paths: Sequence[Path | str]) -> FeatureLayout:
    """The features of feature files (dense, categorical, multi-hot), which must agree."""
    layouts = {}
    for path in paths:
        layout = feature_layout(pq.read_schema(path))
        layouts[(layout.dense, layout.sparse, layout.multi_hot)] = layout
    if len(layouts) > 1:
        described = sorted(f"{list(sparse)} (multi-hot {list(multi_hot)})" for _, sparse, multi_hot in layouts)
        raise ValueError(f"feature files disagree on their features: {described}; preprocess every day with the same state")
    if not layouts:
        raise ValueError("no feature files to read")
    return next(iter(layouts.values()))


@dataclass(frozen=True)
class Rows:
    """Decoded rows: dense [n, dense features], one id column [n] per one-hot feature, one (lengths [n],
    ids) bag per multi-hot feature, labels [n].

    Id columns stay as decoded (views of the Arrow buffers): a batch copies each of its ids
    once, straight into the KJT's feature-major values.
    """

    dense: np.ndarray
    ids: tuple[np.ndarray, ...]
    bags: tuple[tuple[np.ndarray, np.ndarray], ...]
    labels: np.ndarray
    hashes: np.ndarray | None = None  # [n] int64 `row_hashes`, where the reader works them out

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray) -> Rows:
        return Rows(self.dense[index], tuple(c[index] for c in self.ids), tuple(_take_bag(*bag, index) for bag in self.bags),
                    self.labels[index], None if self.hashes is None else self.hashes[index])  # fmt: skip

    def slice(self, start: int, stop: int | None = None) -> Rows:
        stop = len(self) if stop is None else min(stop, len(self))
        bags = []
        for lengths, values in self.bags:
            before, inside = int(lengths[:start].sum()), int(lengths[start:stop].sum())
            bags.append((lengths[start:stop], values[before : before + inside]))
        return Rows(self.dense[start:stop], tuple(c[start:stop] for c in self.ids), tuple(bags), self.labels[start:stop],
                    None if self.hashes is None else self.hashes[start:stop])  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[Rows]) -> Rows:
        bags = tuple(
            (np.concatenate([p.bags[i][0] for p in parts]), np.concatenate([p.bags[i][1] for p in parts]))
            for i in range(len(parts[0].bags))
        )
        ids = tuple(np.concatenate([p.ids[i] for p in parts]) for i in range(len(parts[0].ids)))
        hashes = None if any(p.hashes is None for p in parts) else np.concatenate([p.hashes for p in parts])
        return Rows(np.concatenate([p.dense for p in parts]), ids, bags, np.concatenate([p.labels for p in parts]), hashes)

    @staticmethod
    def empty(dense: int, one_hot: int, multi_hot: int, hashed: bool = False) -> Rows:
        bag = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        return Rows(np.zeros((0, dense), np.float32), (np.zeros(0, np.int64),) * one_hot,
                    (bag,) * multi_hot, np.zeros(0, np.float32), np.zeros(0, np.int64) if hashed else None)  # fmt: skip


# Each feature's factor in a row's hash: its place in the KJT's keys (1-based) × this.
HASH_FACTOR = 0x9E3779B1


def row_hashes(rows: Rows, sparse: Sequence[str], one_hot: Sequence[str], multi_hot: Sequence[str]) -> np.ndarray:
    """A 64-bit hash per row, of its ids and its label (the trained-rows ledger's, in
    training/loop/checkpoint.py): Σ over the row's ids x of feature f (its place in `sparse`,
    the KJT's key order) of x · (f + 1) · HASH_FACTOR, then × 31 + label; every product and
    sum wraps mod 2**64 (int64). Independent of where the row is in the files."""
    place = {name: i + 1 for i, name in enumerate(sparse)}
    summed = np.zeros(len(rows), np.int64)
    for name, column in zip(one_hot, rows.ids, strict=True):
        summed += column.astype(np.int64, copy=False) * np.int64(place[name] * HASH_FACTOR)
    for name, (lengths, values) in zip(multi_hot, rows.bags, strict=True):
        per_row = np.zeros(len(rows), np.int64)
        np.add.at(per_row, np.repeat(np.arange(len(rows)), lengths), values.astype(np.int64, copy=False))
        summed += per_row * np.int64(place[name] * HASH_FACTOR)
    return summed * np.int64(31) + rows.labels.astype(np.int64)


def _take_bag(lengths: np.ndarray, values: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bags of rows `index`, in that order."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))[index]
    taken = lengths[index]
    new_starts = np.concatenate(([0], np.cumsum(taken)[:-1]))
    gather = np.repeat(starts - new_starts, taken) + np.arange(int(taken.sum()))
    return taken, values[gather]


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
        decode_threads: int = 1,
        crosses: Sequence[Cross] = (),
        count_bins: Sequence[CountBins] = (),
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.batch_size, self.drop_remainder, self.prefetch = batch_size, drop_remainder, prefetch
        self.decode_threads = decode_threads
        self.shuffle_seed, self.epoch = shuffle_seed, epoch
        groups = list_row_groups(paths)
        total = sum(rows for _, _, rows in groups)
        order_seed = None if shuffle_seed is None else [shuffle_seed, epoch]
        self.segments = rank_segments(groups, rank, world_size, order_seed)
        layout = files_layout(paths)
        self.dense, self.multi_hot = layout.dense, layout.multi_hot
        self.file_one_hot = tuple(name for name in layout.sparse if name not in self.multi_hot)  # the files' columns
        self.crosses, self.count_bins = tuple(crosses), tuple(count_bins)
        _check_crosses(self.crosses, self.file_one_hot)
        _check_count_bins(self.count_bins, self.dense)
        derived = (*(cross.name for cross in self.crosses), *(bins.name for bins in self.count_bins))
        self.sparse = (*layout.sparse, *derived)
        self.one_hot = (*self.file_one_hot, *derived)
        self.rank_rows = sum(s.rows for s in self.segments)
        self.num_batches = batches_per_rank(total, batch_size, world_size, drop_remainder)
        self.start_batch = min(start_batch, self.num_batches)

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[Batch]:
        return prefetched((self._to_batch(rows) for rows in self._batch_rows(hashed=False)), self.prefetch,
                          name="batch-prefetch")  # fmt: skip

    def with_row_sums(self) -> Iterator[tuple[Batch, int, int]]:
        """Each batch with its real rows' count and the sum of their hashes mod 2**64 (padding
        rows are neither), read ahead like the batches."""
        return prefetched((self._with_sums(rows) for rows in self._batch_rows(hashed=True)), self.prefetch,
                          name="batch-prefetch")  # fmt: skip

    def _with_sums(self, rows: Rows) -> tuple[Batch, int, int]:
        assert rows.hashes is not None
        real = rows.labels != PAD_LABEL
        return self._to_batch(rows), int(real.sum()), int(rows.hashes[real].sum(dtype=np.int64)) % 2**64

    def _batch_rows(self, hashed: bool) -> Iterator[Rows]:
        emitted = self.start_batch
        rows = _RowBuffer(Rows.empty(len(self.dense), len(self.one_hot), len(self.multi_hot), hashed))
        for part in self._rows_from(self.start_batch * self.batch_size, hashed):
            rows.append(part)
            while len(rows) >= self.batch_size and emitted < self.num_batches:
                yield rows.take(self.batch_size)
                emitted += 1
        while emitted < self.num_batches:  # evaluation only: pad the tail to full batches
            yield _pad(rows.take(len(rows)), self.batch_size)
            emitted += 1

    def _rows_from(self, skip: int, hashed: bool = False) -> Iterator[Rows]:
        """Decoded segments in order, starting `skip` rows into this rank's stream."""
        wanted: list[tuple[int, Segment, int]] = []  # (index, segment, rows to skip in it)
        for index, segment in enumerate(self.segments):
            if skip >= segment.rows:
                skip -= segment.rows
                continue
            wanted.append((index, segment, skip))
            skip = 0
        decode = functools.partial(self._decode, hashed=hashed)
        if self.decode_threads <= 1:
            handles: dict[str, pq.ParquetFile] = {}  # open files, footers parsed once per pass
            yield from (decode(item, handles) for item in wanted)
            return
        yield from in_order(decode, wanted, self.decode_threads)

    def _decode(self, item: tuple[int, Segment, int], handles: dict[str, pq.ParquetFile] | None = None,
                hashed: bool = False) -> Rows:  # fmt: skip
        """One segment's rows: decoded, hashed (for the ledger) and shuffled as the seed says."""
        index, segment, skip = item
        handles = _thread_handles() if handles is None else handles
        if segment.path not in handles:
            handles[segment.path] = pq.ParquetFile(segment.path)
        rows = _read_segment(handles[segment.path], segment, self.dense, self.file_one_hot, self.multi_hot)
        if self.crosses:
            rows = _with_crosses(rows, self.crosses, self.file_one_hot)
        if self.count_bins:
            rows = _with_count_bins(rows, self.count_bins, self.dense)
        if hashed:  # a row group at a time: carried along through the shuffle and the batches
            rows = dataclasses.replace(rows, hashes=row_hashes(rows, self.sparse, self.one_hot, self.multi_hot))
        if self.shuffle_seed is not None:
            # in-memory shuffle of one row group; seeded so a resumed run replays it
            rng = np.random.default_rng([self.shuffle_seed, self.epoch, index])
            rows = rows.take(rng.permutation(len(rows)))
        return rows.slice(skip) if skip else rows

    def _to_batch(self, rows: Rows) -> Batch:
        return _to_batch(rows, self.sparse, self.one_hot, self.multi_hot)


def build_reader(
    paths: Sequence[Path | str], batch_size: int, rank: int = 0, world_size: int = 1, **options
) -> BatchReader:
    """The reader for one rank; see `BatchReader` for options."""
    return BatchReader(paths, batch_size, rank, world_size, **options)


def in_order(function: Callable[[T], R], items: Sequence[T], threads: int) -> Iterator[R]:
    """`function` over `items` in `threads` threads, yielded in the items' order, at most
    `threads` + 1 results ahead of the consumer (decoded segments are large). Parquet
    decoding and numpy's copies release the GIL, so the threads decode side by side."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="segment-decode") as pool:
        pending: deque[Future[R]] = deque()
        queued = iter(items)
        try:
            for item in itertools.islice(queued, threads + 1):
                pending.append(pool.submit(function, item))
            while pending:
                result = pending.popleft().result()
                for item in itertools.islice(queued, 1):
                    pending.append(pool.submit(function, item))
                yield result
        finally:
            for future in pending:  # a consumer that stops early leaves nothing running
                future.cancel()


_local = threading.local()


def _thread_handles() -> dict[str, pq.ParquetFile]:
    """This thread's open files: a `ParquetFile` is read by one thread at a time."""
    if not hasattr(_local, "handles"):
        _local.handles = {}
    return _local.handles


def _check_crosses(crosses: Sequence[Cross], one_hot: Sequence[str]) -> None:
    wrong = [cross.name for cross in crosses if cross.first not in one_hot or cross.second not in one_hot]
    if wrong:
        raise ValueError(f"crosses {wrong}: each crosses two one-id features of the files ({list(one_hot)})")


def _with_crosses(rows: Rows, crosses: Sequence[Cross], one_hot: Sequence[str]) -> Rows:
    """`rows` with each cross's id column after the files' own."""
    column = {name: ids for name, ids in zip(one_hot, rows.ids, strict=True)}
    crossed = tuple(cross_rows(column[c.first], column[c.second], c.rows) for c in crosses)
    return dataclasses.replace(rows, ids=(*rows.ids, *crossed))


def _check_count_bins(count_bins: Sequence[CountBins], dense: Sequence[str]) -> None:
    wrong = [bins.name for bins in count_bins if bins.feature not in dense]
    if wrong:
        raise ValueError(f"count bins {wrong}: each cuts a dense feature of the files ({list(dense)})")


def _with_count_bins(rows: Rows, count_bins: Sequence[CountBins], dense: Sequence[str]) -> Rows:
    """`rows` with each count's bin column after the other id columns."""
    binned = tuple(bin_rows(rows.dense[:, dense.index(bins.feature)], bins.edges) for bins in count_bins)
    return dataclasses.replace(rows, ids=(*rows.ids, *binned))


def _read_segment(handle: pq.ParquetFile, segment: Segment, dense_columns: Sequence[str], one_hot: Sequence[str],
                  multi_hot: Sequence[str]) -> Rows:  # fmt: skip
    table = handle.read_row_group(segment.row_group)
    table = table.slice(segment.start, segment.rows)
    dense = (np.column_stack([table[c].to_numpy() for c in dense_columns]).astype(np.float32, copy=False)
             if dense_columns else np.zeros((table.num_rows, 0), np.float32))  # fmt: skip
    ids = tuple(table[c].combine_chunks().to_numpy() for c in one_hot)  # zero-copy views
    labels = table["label"].to_numpy().astype(np.float32)
    return Rows(dense, ids, tuple(_bag(table[c].combine_chunks()) for c in multi_hot), labels)


def _bag(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column → (ids per row, all ids); preprocessing never writes a null or empty bag."""
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy()[offsets[0] : offsets[-1]]
    return np.diff(offsets).astype(np.int64), values.astype(np.int64)


class _RowBuffer:
    """Decoded rows waiting to be cut into batches."""

    def __init__(self, empty: Rows) -> None:
        self.parts: list[Rows] = []
        self.empty = empty
        self.rows = 0

    def __len__(self) -> int:
        return self.rows

    def append(self, rows: Rows) -> None:
        if len(rows):
            self.parts.append(rows)
            self.rows += len(rows)

    def take(self, n: int) -> Rows:
        """The first n rows (fewer if fewer are left); copies only rows that span parts."""
        taken: list[Rows] = []
        while n > 0 and self.parts:
            head = self.parts[0]
            if len(head) > n:
                taken.append(head.slice(0, n))
                self.parts[0] = head.slice(n)
            else:
                taken.append(self.parts.pop(0))
            n -= len(taken[-1])
            self.rows -= len(taken[-1])
        if not taken:
            return self.empty
        return taken[0] if len(taken) == 1 else Rows.concat(taken)


def _pad(rows: Rows, size: int) -> Rows:
    missing = size - len(rows)
    one_id = (np.ones(missing, np.int64), np.zeros(missing, np.int64))
    padding = Rows(np.zeros((missing, rows.dense.shape[1]), np.float32), (np.zeros(missing, np.int64),) * len(rows.ids),
                   (one_id,) * len(rows.bags), np.full(missing, PAD_LABEL, np.float32),
                   None if rows.hashes is None else np.full(missing, -1, np.int64))  # fmt: skip
    return Rows.concat([rows, padding])


def _to_batch(rows: Rows, sparse: Sequence[str], one_hot: Sequence[str], multi_hot: Sequence[str]) -> Batch:
    """Rows → a TorchRec Batch; the KJT's keys are the features in column order."""
    dense, labels = rows.dense, rows.labels
    batch_size = len(labels)
    if not multi_hot:
        values = torch.from_numpy(np.concatenate(rows.ids, dtype=np.int64))  # feature-major, one copy
        lengths = _ones(len(sparse) * batch_size)
    else:
        column_of = {name: i for i, name in enumerate(one_hot)}
        bag_of = {name: i for i, name in enumerate(multi_hot)}
        value_parts, length_parts = [], []
        for name in sparse:
            if name in bag_of:
                bag_lengths, bag_values = rows.bags[bag_of[name]]
                value_parts.append(bag_values)
                length_parts.append(bag_lengths.astype(np.int32))
            else:
                value_parts.append(rows.ids[column_of[name]])
                length_parts.append(np.ones(batch_size, np.int32))
        values = torch.from_numpy(np.concatenate(value_parts, dtype=np.int64))
        lengths = torch.from_numpy(np.concatenate(length_parts))
    kjt = KeyedJaggedTensor(keys=list(sparse), values=values, lengths=lengths, stride=batch_size)
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
    )


@functools.lru_cache(maxsize=4)
def _ones(n: int) -> torch.Tensor:
    """One id per (feature, example): the same lengths tensor serves every full batch."""
    return torch.ones(n, dtype=torch.int32)


def first_ids(kjt: KeyedJaggedTensor, feature: str) -> torch.Tensor:
    """Per example, the feature's id (a multi-hot feature's first id). Every example the
    reader yields has at least one id per feature (missing is id 0)."""
    jagged = kjt[feature]
    return jagged.values()[jagged.offsets()[:-1]]


def example_of_values(kjt: KeyedJaggedTensor) -> torch.Tensor:
    """For each of the KJT's values (feature-major), the example it belongs to."""
    lengths = kjt.lengths().to(torch.int64)
    examples = torch.arange(len(lengths), device=lengths.device) % kjt.stride()
    return torch.repeat_interleave(examples, lengths)
