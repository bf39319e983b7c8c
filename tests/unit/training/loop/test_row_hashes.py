"""The trained-rows fingerprint's per-row hash (ingestion/reader.row_hashes), against a
pure-Python oracle; and the reader's per-batch sums of it against the oracle on real files."""

import numpy as np
import pyarrow.parquet as pq

from ingestion.reader import HASH_FACTOR, PAD_LABEL, Rows, build_reader, row_hashes
from ingestion.schema import SPARSE_COLUMNS


def oracle(ids_per_feature: list[list[list[int]]], labels: list[int]) -> list[int]:
    """Σ over features f and ids x of the row's bag: x · (f + 1) · HASH_FACTOR; × 31 + label; mod 2⁶⁴."""
    hashes = []
    for row, label in enumerate(labels):
        total = sum(x * (f + 1) * HASH_FACTOR for f, bags in enumerate(ids_per_feature) for x in bags[row])
        hashes.append((total * 31 + label) % 2**64)
    return hashes


def rows_of(ids_per_feature: list[list[list[int]]], labels: list[int], multi_hot: set[int]) -> tuple[Rows, list, list, list]:
    """Rows holding the features (those in `multi_hot` as bags), and the reader's key lists."""
    keys = [f"C{f + 1}" for f in range(len(ids_per_feature))]
    one_hot = [k for f, k in enumerate(keys) if f not in multi_hot]
    bags = [k for f, k in enumerate(keys) if f in multi_hot]
    ids = tuple(np.array([bag[0] for bag in ids_per_feature[f]], np.int32) for f in range(len(keys)) if f not in multi_hot)
    bag_arrays = tuple((np.array([len(b) for b in ids_per_feature[f]], np.int64),
                        np.array([x for b in ids_per_feature[f] for x in b], np.int64))
                       for f in range(len(keys)) if f in multi_hot)  # fmt: skip
    rows = Rows(np.zeros((len(labels), 13), np.float32), ids, bag_arrays, np.array(labels, np.float32))
    return rows, keys, one_hot, bags


def as_unsigned(hashes: np.ndarray) -> list[int]:
    return [int(h) % 2**64 for h in hashes]


def test_single_hot_rows_hash_as_the_oracle_says() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**31 - 1, (26, 64)).tolist()
    features = [[[x] for x in row] for row in ids]
    labels = rng.integers(0, 2, 64).tolist()
    rows, keys, one_hot, bags = rows_of(features, labels, set())
    assert as_unsigned(row_hashes(rows, keys, one_hot, bags)) == oracle(features, labels)


def test_multi_hot_and_missing_bags_hash_as_the_oracle_says_in_the_keys_order() -> None:
    """Bags (an empty one included) between one-hot features: each feature weighs by its place
    among the keys, not among its kind."""
    features = [[[5], [2], [2**31 - 2]], [[1, 8], [], [4]], [[7], [9], [0]], [[3], [9, 9, 9], [0]]]
    labels = [1, 0, 1]
    rows, keys, one_hot, bags = rows_of(features, labels, {1, 3})
    assert as_unsigned(row_hashes(rows, keys, one_hot, bags)) == oracle(features, labels)


def test_hashing_leaves_the_rows_as_they_were() -> None:
    features = [[[11], [12]], [[13], [14]]]
    rows, keys, one_hot, bags = rows_of(features, [0, 1], set())
    before = [column.copy() for column in rows.ids]
    row_hashes(rows, keys, one_hot, bags)
    assert all(np.array_equal(a, b) for a, b in zip(rows.ids, before, strict=True))


def test_the_readers_sums_are_the_oracles_over_each_batchs_real_rows(tiny_features) -> None:
    """Shuffled, resumed mid-epoch, with a padded last batch: each batch's count and hash sum
    are the oracle's over its real rows, and the batches are the plain reader's."""
    _, files = tiny_features
    options = {"shuffle_seed": 3, "epoch": 1, "drop_remainder": False, "start_batch": 2}
    plain = list(build_reader(files[0], 700, 1, 2, **options))
    with_sums = list(build_reader(files[0], 700, 1, 2, **options).with_row_sums())
    assert len(plain) == len(with_sums) and (plain[-1].labels == PAD_LABEL).any(), "the last batch is padded"
    for batch, (same, rows, hash_sum) in zip(plain, with_sums, strict=True):
        assert all(a.equal(b) for a, b in ((batch.dense_features, same.dense_features), (batch.labels, same.labels),
                                           (batch.sparse_features.values(), same.sparse_features.values())))  # fmt: skip
        n, real = len(batch.labels), (batch.labels != PAD_LABEL).numpy()
        values = batch.sparse_features.values().view(len(SPARSE_COLUMNS), n).numpy()
        features = [[[int(x)] for x in values[f][real]] for f in range(len(SPARSE_COLUMNS))]
        expected = oracle(features, [int(label) for label in batch.labels.numpy()[real]])
        assert rows == int(real.sum()) and hash_sum == sum(expected) % 2**64
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in files[0]) == 6000
