import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from ingestion.reader import PAD_LABEL, build_reader
from ingestion.schema import DENSE_COLUMNS, SPARSE_COLUMNS


def _row_keys(batches) -> list[tuple]:
    """Identify rows by their full content (dense + sparse + label)."""
    keys = []
    for batch in batches:
        n = len(batch.labels)
        sparse = batch.sparse_features.values().view(len(SPARSE_COLUMNS), n).T.numpy()
        dense = batch.dense_features.numpy()
        labels = batch.labels.numpy()
        keys += [(float(labels[i]), *dense[i].tolist(), *sparse[i].tolist()) for i in range(n) if labels[i] != PAD_LABEL]
    return keys


def _all_rows(files) -> list[tuple]:
    table = pq.read_table(files, partitioning=None)
    columns = [table["label"].to_numpy().astype(np.float32)] + [table[c].to_numpy() for c in (*DENSE_COLUMNS, *SPARSE_COLUMNS)]
    return [tuple(float(v) if j <= 13 else int(v) for j, v in enumerate(row)) for row in zip(*columns)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_are_disjoint_cover_the_epoch_and_take_equal_steps(tiny_features, world_size: int) -> None:
    _, files = tiny_features
    paths = files[0] + files[1]
    readers = [build_reader(paths, 500, rank, world_size, drop_remainder=False) for rank in range(world_size)]
    assert len({len(r) for r in readers}) == 1, "every rank yields the same number of batches"
    keys = [k for r in readers for k in _row_keys(r)]
    assert len(keys) == 12_000
    assert sorted(keys) == sorted(_all_rows(paths)), "the union is the dataset, no duplicates"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_training_readers_drop_the_same_small_remainder(tiny_features, world_size: int) -> None:
    _, files = tiny_features
    readers = [build_reader(files[0], 256, rank, world_size) for rank in range(world_size)]
    lengths = [len(list(r)) for r in readers]
    assert len(set(lengths)) == 1 and lengths[0] == (6000 // world_size) // 256
    trained = lengths[0] * 256 * world_size
    assert 6000 - trained < world_size * (256 + 1)


def test_batches_have_torchrec_shapes(tiny_features) -> None:
    state, files = tiny_features
    batch = next(iter(build_reader(files[2], 128)))
    assert batch.dense_features.shape == (128, 13) and batch.dense_features.dtype.is_floating_point
    assert batch.labels.shape == (128,)
    kjt = batch.sparse_features
    assert kjt.keys() == list(SPARSE_COLUMNS)
    assert kjt.lengths().tolist() == [1] * (26 * 128)
    assert kjt.values().shape == (26 * 128,)
    by_feature = kjt.to_dict()
    for name in SPARSE_COLUMNS:
        assert by_feature[name].values().max() < state.table_sizes[name]


def test_shuffle_is_seeded_changes_per_epoch_and_keeps_the_rows(tiny_features) -> None:
    _, files = tiny_features
    paths = files[0] + files[1]
    plain = _row_keys(build_reader(paths, 1000))
    epoch0 = _row_keys(build_reader(paths, 1000, shuffle_seed=3, epoch=0))
    again = _row_keys(build_reader(paths, 1000, shuffle_seed=3, epoch=0))
    epoch1 = _row_keys(build_reader(paths, 1000, shuffle_seed=3, epoch=1))
    assert epoch0 == again
    assert epoch0 != plain and epoch0 != epoch1
    assert sorted(epoch0) == sorted(plain) == sorted(epoch1)


def test_resume_from_a_batch_position_replays_the_rest(tiny_features) -> None:
    _, files = tiny_features
    paths = files[0] + files[1]
    whole = list(build_reader(paths, 700, 1, 2, shuffle_seed=5))
    resumed = list(build_reader(paths, 700, 1, 2, shuffle_seed=5, start_batch=3))
    assert len(resumed) == len(whole) - 3
    assert _row_keys(resumed) == _row_keys(whole[3:])


def test_stopping_early_does_not_hang(tiny_features) -> None:
    _, files = tiny_features
    before = set(threading.enumerate())
    reader = iter(build_reader(files[0], 64, prefetch=2))
    next(reader)
    (producer,) = [t for t in threading.enumerate() if t not in before and t.name == "batch-prefetch"]
    reader.close()  # the producer thread sees the stop and exits
    producer.join(timeout=10)
    assert not producer.is_alive(), "the producer thread is still running after its reader was closed"


@pytest.mark.parametrize("start_batch", [0, 3])
def test_row_groups_decoded_side_by_side_give_the_same_batches_and_sums(tiny_features, start_batch: int) -> None:
    """`decode_threads` decodes, hashes and shuffles row groups in parallel threads; the
    batches, their real rows and their hash sums are those of one thread, in the same order."""
    _, files = tiny_features
    paths = files[0] + files[1]
    options = {"shuffle_seed": 5, "epoch": 1, "start_batch": start_batch, "drop_remainder": False}
    one = list(build_reader(paths, 300, 1, 2, decode_threads=1, **options).with_row_sums())
    three = list(build_reader(paths, 300, 1, 2, decode_threads=3, **options).with_row_sums())
    assert len(one) == len(three) > 5
    assert [(rows, sums) for _, rows, sums in one] == [(rows, sums) for _, rows, sums in three]
    assert _row_keys(b for b, _, _ in one) == _row_keys(b for b, _, _ in three)


def test_a_reader_stopped_early_leaves_no_decoding_thread(tiny_features) -> None:
    _, files = tiny_features
    reader = iter(build_reader(files[0] + files[1], 64, decode_threads=3, prefetch=0))
    next(reader)
    reader.close()
    deadline = time.time() + 10
    while any(t.name.startswith("segment-decode") for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("segment-decode")]
