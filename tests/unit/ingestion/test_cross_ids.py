"""Crossed pairs of features (ingestion/cross_ids.py): the rows of a cross, its table's size,
the reader's id columns for it, and the preprocessing state that keeps it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ingestion.bucket_count import rows_lost
from ingestion.count_bins import CountBins
from ingestion.cross_ids import Cross, combined_keys, cross_rows, crosses_from
from ingestion.crosses import cross_table_rows
from ingestion.preprocess import PreprocessState
from ingestion.reader import PAD_LABEL, build_reader


def test_a_cross_gives_each_combination_one_row_whatever_the_order_of_rows() -> None:
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 2**31 - 1, 5_000), rng.integers(0, 2**31 - 1, 5_000)
    keys = combined_keys(first, second)
    pairs = set(zip(first.tolist(), second.tolist(), strict=True))
    assert len(np.unique(keys)) == len(pairs), "the key is exact: one per combination"
    rows = cross_rows(first, second, 1_009)
    assert rows.dtype == np.int64 and rows.min() >= 0 and rows.max() < 1_009
    order = rng.permutation(5_000)
    np.testing.assert_array_equal(cross_rows(first[order], second[order], 1_009), rows[order])
    # (a, b) and (b, a) are different combinations
    assert cross_rows(np.array([3]), np.array([5]), 1 << 20)[0] != cross_rows(np.array([5]), np.array([3]), 1 << 20)[0]


def test_a_crosss_table_keeps_its_frequent_combinations_apart() -> None:
    rng = np.random.default_rng(1)
    first = rng.integers(1, 9, 20_000)  # 8 × 12 combinations, each seen about 200 times
    second = rng.integers(1, 13, 20_000)
    rows = cross_table_rows(first, second, most_rows=100_000)
    keys, counts = np.unique(combined_keys(first, second), return_counts=True)
    assert 2 * len(keys) <= rows < 2 * len(keys) + 4_096
    assert rows_lost(keys, counts, rows) == 0, "no frequent combination shares its row"
    assert cross_table_rows(first, second, most_rows=50) == 50, "never above the cap"


def test_the_reader_adds_each_cross_as_an_id_column_after_the_files_features(multi_hot_features) -> None:
    _, files = multi_hot_features
    crosses = (Cross("C1", "C2", 97), Cross("C5", "C1", 13))
    plain = list(build_reader(files[0], 700, drop_remainder=False))
    crossed = list(build_reader(files[0], 700, drop_remainder=False, crosses=crosses))
    assert len(plain) == len(crossed)
    for before, after in zip(plain, crossed, strict=True):
        kjt = after.sparse_features
        own = before.sparse_features.keys()
        assert kjt.keys() == [*own, "C1_x_C2", "C5_x_C1"]
        for name in own:  # the files' features unchanged
            np.testing.assert_array_equal(kjt[name].values().numpy(), before.sparse_features[name].values().numpy())
        for cross in crosses:
            expected = cross_rows(kjt[cross.first].values().numpy(), kjt[cross.second].values().numpy(), cross.rows)
            np.testing.assert_array_equal(kjt[cross.name].values().numpy(), expected)
            assert kjt[cross.name].lengths().tolist() == [1] * len(after.labels)
    # the files' rows in order, every one crossed
    table = pq.read_table(files[0], partitioning=None)
    real = np.concatenate([b.labels.numpy() for b in crossed]) != PAD_LABEL
    got = np.concatenate([b.sparse_features["C1_x_C2"].values().numpy() for b in crossed])[real]
    np.testing.assert_array_equal(got, cross_rows(table["C1"].to_numpy(), table["C2"].to_numpy(), 97))


def test_the_ledger_hashes_a_crossed_row_the_same_way_on_every_read(multi_hot_features) -> None:
    _, files = multi_hot_features
    crosses = (Cross("C1", "C2", 97),)
    one = build_reader(files[0], 500, drop_remainder=False, crosses=crosses)
    threaded = build_reader(files[0], 500, drop_remainder=False, crosses=crosses, decode_threads=3)
    sums = [(rows, total) for _, rows, total in one.with_row_sums()]
    assert sums == [(rows, total) for _, rows, total in threaded.with_row_sums()]
    assert sum(rows for rows, _ in sums) == sum(pq.ParquetFile(f).metadata.num_rows for f in files[0])


def test_a_cross_of_a_bag_or_of_an_unknown_feature_is_refused(multi_hot_features) -> None:
    _, files = multi_hot_features
    with pytest.raises(ValueError, match="each crosses two one-id features"):
        build_reader(files[0], 500, crosses=(Cross("C1", "C3", 10),))  # C3 holds bags
    with pytest.raises(ValueError, match="C1_x_nope"):
        build_reader(files[0], 500, crosses=(Cross("C1", "nope", 10),))


def test_the_state_keeps_its_crosses_and_count_bins_and_their_tables_follow_the_features(tiny_features,
                                                                                         tmp_path: Path) -> None:  # fmt: skip
    state, _ = tiny_features
    crosses = (Cross("C6", "C11", 69), Cross("C18", "C19", 60))
    count_bins = (CountBins("I6", (0.25, 1.5, 3.0)),)
    crossed = dataclasses.replace(state, crosses=crosses, count_bins=count_bins)
    crossed.save(tmp_path / "state.json")
    loaded = PreprocessState.load(tmp_path / "state.json")
    assert loaded == crossed and loaded.crosses == crosses and loaded.count_bins == count_bins
    assert loaded.table_sizes == state.table_sizes, "the features' own tables are unchanged"
    assert list(loaded.model_table_sizes) == [*state.table_sizes, "C6_x_C11", "C18_x_C19", "I6_bins"]
    assert loaded.model_table_sizes["C18_x_C19"] == 60 and loaded.model_table_sizes["I6_bins"] == 4
    assert crosses_from([dataclasses.asdict(c) for c in crosses]) == crosses
    state.save(tmp_path / "plain.json")
    assert PreprocessState.load(tmp_path / "plain.json").crosses == () == PreprocessState.load(tmp_path / "plain.json").count_bins


@pytest.mark.parametrize("mode", ["hash", "vocab"])
def test_a_continued_state_keeps_its_parents_crosses(tiny_warehouse: Path, tmp_path: Path, mode: str) -> None:
    """A night extends its champion's state: the crosses and count bins come with it, in either mode, and
    again when the continued vocabulary is read back from an earlier night's folder."""
    from ingestion.preprocess import continue_state, fit_state
    from tests.conftest import TINY_PREPROCESS

    config = dataclasses.replace(TINY_PREPROCESS, categorical_mode=mode, hash_size=500)
    crosses, count_bins = (Cross("C6", "C11", 69),), (CountBins("I2", (0.5, 2.0)),)
    parent = dataclasses.replace(fit_state(config, tiny_warehouse, tmp_path, (0,)), crosses=crosses, count_bins=count_bins)
    child = continue_state(config, parent, tiny_warehouse, tmp_path, (1,))
    assert child.crosses == crosses and child.count_bins == count_bins
    assert child.model_table_sizes == parent.model_table_sizes
    again = continue_state(config, parent, tiny_warehouse, tmp_path, (1,))
    assert (again.crosses, again.count_bins) == (crosses, count_bins)
