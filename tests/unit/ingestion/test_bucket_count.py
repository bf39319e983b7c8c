"""Hash mode's bucket counts: frequent values kept apart, rare ones left to share, many at
twice their ids, always bounded."""

from __future__ import annotations

import numpy as np

from ingestion.bucket_count import FREQUENT, SEARCHED_IDS, bucket_count, rows_lost


def _lost_by_brute_force(ids: np.ndarray, rows: np.ndarray, buckets: int) -> int:
    by_bucket: dict[int, list[int]] = {}
    for value, seen in zip(ids.tolist(), rows.tolist()):
        by_bucket.setdefault(value % buckets, []).append(seen)
    return sum(sum(n for n in sorted(seen)[:-1] if n >= FREQUENT) for seen in by_bucket.values())


def test_rows_lost_counts_the_frequent_rows_of_every_id_but_its_buckets_most_frequent():
    rng = np.random.default_rng(3)
    ids = rng.choice(2**32, size=300, replace=False).astype(np.uint32)
    rows = rng.integers(1, 50, size=300)
    for buckets in (7, 64, 600, 601):
        assert rows_lost(ids, rows, buckets) == _lost_by_brute_force(ids, rows, buckets)


def test_a_feature_of_few_values_gets_buckets_that_keep_every_value_apart():
    # three 32-bit ids that collide at 6 buckets (twice the ids), as Criteo's hashed ids do
    ids = np.array([6, 12, 7], dtype=np.uint32)
    rows = np.array([500, 400, 300])
    assert rows_lost(ids, rows, 6) == 400
    buckets = bucket_count(ids, rows, most=99_999)
    assert buckets == 7 and len(set((ids % buckets).tolist())) == 3


def test_signed_ids_map_as_the_preprocessing_sql_does_nonnegative_remainders():
    ids = np.array([-5, 1, 9, -1], dtype=np.int64)
    buckets = bucket_count(ids, np.full(4, FREQUENT, dtype=np.int64), most=1_000)
    rows = 1 + ((ids % buckets) + buckets) % buckets  # the SQL's signed form
    assert len(set(rows.tolist())) == 4 and rows.min() >= 1 and rows.max() <= buckets


def test_frequent_values_are_kept_apart_when_every_value_cannot_be():
    rng = np.random.default_rng(5)
    ids = rng.choice(2**32, size=2_000, replace=False).astype(np.uint32)
    rows = (10_000 / np.arange(1, 2_001) ** 1.2).astype(np.int64) + 1  # a power law
    buckets = bucket_count(ids, rows, most=99_999)
    assert 4_000 <= buckets < 4_000 + 4_096
    assert rows_lost(ids, rows, 4_000) > 0 and rows_lost(ids, rows, buckets) < rows_lost(ids, rows, 4_000)
    assert all(rows_lost(ids, rows, other) >= rows_lost(ids, rows, buckets) for other in range(4_000, buckets))


def test_rare_ids_that_share_rows_do_not_grow_the_table():
    ids = np.arange(100, dtype=np.int64) * 200  # every id on row 0 of 200 buckets
    rows = np.full(100, FREQUENT - 1)
    assert rows_lost(ids, rows, 200) == 0 and bucket_count(ids, rows, most=99_999) == 200
    rows[:2] = FREQUENT  # two frequent ones among them: kept apart
    assert bucket_count(ids, rows, most=99_999) > 200


def test_the_table_never_passes_its_most_rows_and_large_features_keep_twice_their_ids():
    ids = np.arange(10, dtype=np.uint32) * 8  # all collide below 8 buckets
    assert bucket_count(ids, np.ones(10, dtype=np.int64), most=12) <= 12
    many = np.arange(SEARCHED_IDS + 1, dtype=np.int64) * 3
    assert bucket_count(many, np.ones(len(many), dtype=np.int64), most=10**9) == 2 * len(many)
    assert bucket_count(np.array([], dtype=np.int64), np.array([], dtype=np.int64), most=50) == 1
