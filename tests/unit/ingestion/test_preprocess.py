import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingestion.preprocess import PreprocessError, apply_state, fit_state, state_id_for
from ingestion.schema import DENSE_COLUMNS, FEATURE_SCHEMA, SPARSE_COLUMNS
from tests.conftest import TINY_PREPROCESS


def test_features_match_a_numpy_oracle(tiny_warehouse: Path, tiny_features) -> None:
    state, files = tiny_features
    raw = pq.read_table(tiny_warehouse / "day=2")
    features = pq.read_table(files[2], partitioning=None)
    assert features.num_rows == raw.num_rows
    assert [(f.name, f.type) for f in features.schema] == [(f.name, f.type) for f in FEATURE_SCHEMA]
    expected = {"label": raw["label"].to_numpy()}
    for name in DENSE_COLUMNS:
        values = raw[name].to_numpy(zero_copy_only=False).astype(np.float64)  # NaN where empty
        expected[name] = np.log1p(np.maximum(np.nan_to_num(values, nan=0.0), 0.0)).astype(np.float32)
    for name in SPARSE_COLUMNS:
        ids = raw[name].to_numpy(zero_copy_only=False).astype(np.float64)
        present = ~np.isnan(ids)
        index = np.zeros(len(ids), dtype=np.int32)
        index[present] = 1 + ids[present].astype(np.int64) % state.buckets[name]
        expected[name] = index
        got = features[name].to_numpy()
        assert got.min() >= 0 and got.max() < state.table_sizes[name]
    # Row by row, in the warehouse's order: the trainer's batches are cut from these files, so
    # an order that changed with the machine's load would train other parameters.
    for name in DENSE_COLUMNS:
        assert np.allclose(features[name].to_numpy(), expected[name], atol=1e-6), name
    for name in ("label", *SPARSE_COLUMNS):
        assert np.array_equal(features[name].to_numpy(), expected[name]), name


def test_state_fits_on_training_days_only(tiny_warehouse: Path, tiny_features) -> None:
    state, _ = tiny_features
    assert state.train_days == (0, 1)
    assert state.train_rows == 12_000
    labels = np.concatenate([pq.read_table(tiny_warehouse / f"day={d}")["label"].to_numpy() for d in (0, 1)])
    assert state.train_click_rate == pytest.approx(labels.mean())
    for rows in state.table_sizes.values():
        assert 2 <= rows <= TINY_PREPROCESS.hash_size


def test_state_is_versioned_and_reused(tiny_warehouse: Path, tmp_path: Path) -> None:
    first = fit_state(TINY_PREPROCESS, tiny_warehouse, tmp_path, (0, 1))
    again = fit_state(TINY_PREPROCESS, tiny_warehouse, tmp_path, (0, 1))
    assert again == first
    other_days = state_id_for(TINY_PREPROCESS, tiny_warehouse, (0,))
    assert other_days != first.state_id
    from dataclasses import replace

    assert state_id_for(replace(TINY_PREPROCESS, hash_size=999), tiny_warehouse, (0, 1)) != first.state_id


def test_applying_twice_reuses_the_day(tiny_warehouse: Path, tmp_path: Path) -> None:
    state = fit_state(TINY_PREPROCESS, tiny_warehouse, tmp_path, (0, 1))
    folder = apply_state(TINY_PREPROCESS, state, tiny_warehouse, tmp_path, 2)
    stamp = (folder / "part-00000.parquet").stat().st_mtime_ns
    assert apply_state(TINY_PREPROCESS, state, tiny_warehouse, tmp_path, 2) == folder
    assert (folder / "part-00000.parquet").stat().st_mtime_ns == stamp


def test_a_missing_day_is_a_clear_error(tiny_warehouse: Path, tmp_path: Path) -> None:
    with pytest.raises(PreprocessError, match="day 9: no Parquet .* ingest that day first"):
        fit_state(TINY_PREPROCESS, tiny_warehouse, tmp_path, (9,))


def _vocabulary_oracle(train: pa.Table, column: str, min_count: int, limit: int) -> dict[int, int]:
    """value → row: the most frequent first (ties by value), rows from 2."""
    values = train[column].drop_null().to_numpy().astype(np.int64)
    unique, counts = np.unique(values, return_counts=True)
    keep = counts >= min_count
    order = np.lexsort((unique[keep], -counts[keep]))[:limit]
    return {int(v): 2 + rank for rank, v in enumerate(unique[keep][order])}


@pytest.mark.parametrize("min_count", [1, 3])
def test_vocabulary_mode_matches_a_numpy_oracle(tiny_warehouse: Path, tmp_path: Path, min_count: int) -> None:
    from dataclasses import replace

    config = replace(TINY_PREPROCESS, categorical_mode="vocab", min_count=min_count, hash_size=500)
    state = fit_state(config, tiny_warehouse, tmp_path, (0, 1))
    assert state.mode == "vocab" and state.state_id != state_id_for(TINY_PREPROCESS, tiny_warehouse, (0, 1))
    train = pa.concat_tables([pq.read_table(tiny_warehouse / f"day={d}") for d in (0, 1)])
    eval_day = pq.read_table(tiny_warehouse / "day=2")
    features = pq.read_table(apply_state(config, state, tiny_warehouse, tmp_path, 2), partitioning=None)
    assert features.num_rows == eval_day.num_rows
    # Row by row, in the warehouse's order (the lookups are joins, which reorder; put back).
    saw_oov = False
    for column in SPARSE_COLUMNS:
        vocabulary = _vocabulary_oracle(train, column, min_count, config.hash_size - 2)
        free = math.ceil(len(vocabulary) * config.vocab_headroom)  # rows for later days' new ids
        assert state.table_sizes[column] == min(config.hash_size, len(vocabulary) + 2 + free)
        stored = pq.read_table(tmp_path / state.state_id / "vocab" / f"{column}.parquet")
        assert dict(zip(stored["value"].to_pylist(), stored["index"].to_pylist(), strict=True)) == vocabulary
        raw = eval_day[column].to_pylist()
        expected = np.array([0 if v is None else vocabulary.get(v, 1) for v in raw])
        got = features[column].to_numpy()
        assert np.array_equal(got, expected), column
        saw_oov |= bool((got == 1).any())
    assert saw_oov, "the eval day has values never seen in training: they share row 1"


def test_vocabulary_keeps_the_most_frequent_values_when_capped(tiny_warehouse: Path, tmp_path: Path) -> None:
    from dataclasses import replace

    config = replace(TINY_PREPROCESS, categorical_mode="vocab", hash_size=12)
    state = fit_state(config, tiny_warehouse, tmp_path, (0, 1))
    assert max(state.table_sizes.values()) == 12
    train = pa.concat_tables([pq.read_table(tiny_warehouse / f"day={d}") for d in (0, 1)])
    column = max(SPARSE_COLUMNS, key=lambda c: len(set(train[c].drop_null().to_pylist())))
    stored = pq.read_table(tmp_path / state.state_id / "vocab" / f"{column}.parquet")
    assert stored.num_rows == 10 and stored["value"].to_pylist() == list(_vocabulary_oracle(train, column, 1, 10))


def _vocabulary(root: Path, state, column: str) -> dict[int, int]:
    stored = pq.read_table(root / state.state_id / "vocab" / f"{column}.parquet")
    return dict(zip(stored["value"].to_pylist(), stored["index"].to_pylist(), strict=True))


@pytest.mark.parametrize("headroom", [0.5, 0.0])
def test_a_continued_vocabulary_keeps_every_row_and_fills_free_ones(tiny_warehouse: Path, tmp_path: Path,
                                                                    headroom: float) -> None:  # fmt: skip
    """Day 0's vocabulary continued on day 1 (a recurring run): the same table sizes, every
    known id on its row, and day 1's new ids (most frequent first) in the free rows only."""
    from dataclasses import replace

    from ingestion.preprocess import continue_state

    config = replace(TINY_PREPROCESS, categorical_mode="vocab", hash_size=500, vocab_headroom=headroom)
    parent = fit_state(config, tiny_warehouse, tmp_path, (0,))
    child = continue_state(config, parent, tiny_warehouse, tmp_path, (1,))
    assert child.parent == parent.state_id != child.state_id and child.train_days == (1,)
    assert child.table_sizes == parent.table_sizes, "the parent's checkpoint loads as it is"
    assert child.train_rows == pq.read_table(tiny_warehouse / "day=1").num_rows
    day1 = pq.read_table(tiny_warehouse / "day=1")
    grew = 0
    for column in SPARSE_COLUMNS:
        before, after = _vocabulary(tmp_path, parent, column), _vocabulary(tmp_path, child, column)
        assert {v: after[v] for v in before} == before, f"{column}: a known id moved"
        new = {v: i for v, i in after.items() if v not in before}
        free = parent.table_sizes[column] - 2 - len(before)
        assert len(new) <= free and sorted(new.values()) == list(range(len(before) + 2, len(before) + 2 + len(new)))
        unseen = [v for v in day1[column].drop_null().to_pylist() if v not in before]
        assert len(new) == min(free, len(set(unseen))), column
        if new:  # the most frequent new ids got the rows
            counts = {v: unseen.count(v) for v in set(unseen)}
            assert min(counts[v] for v in new) >= max([counts[v] for v in counts if v not in new], default=0)
        assert child.buckets[column] == len(after)
        grew += len(new)
    assert (grew > 0) == (headroom > 0)
    features = pq.read_table(apply_state(config, child, tiny_warehouse, tmp_path, 2), partitioning=None)
    assert all(int(features[c].to_numpy().max()) < child.table_sizes[c] for c in SPARSE_COLUMNS)


def test_managed_mode_keeps_raw_ids_with_the_missing_id_and_hash_sized_tables(tiny_warehouse: Path,
                                                                               tmp_path: Path) -> None:  # fmt: skip
    """Managed mode's features are the warehouse's ids themselves (BIGINT), a missing one the
    id −2^63, in the warehouse's row order; tables as hash mode sizes them."""
    import dataclasses

    from ingestion.preprocess import MISSING_ID

    managed = dataclasses.replace(TINY_PREPROCESS, categorical_mode="managed")
    state = fit_state(managed, tiny_warehouse, tmp_path, [0, 1])
    hashed = fit_state(TINY_PREPROCESS, tiny_warehouse, tmp_path / "hash", [0, 1])
    assert state.mode == "managed" and state.state_id != hashed.state_id
    # twice the ids, as hash mode sizes a feature of many ids; hash mode gives a feature of few
    # more buckets to keep its values apart, which admitted ids, each on its own row, need not
    large = [name for name, rows in state.table_sizes.items() if rows == managed.hash_size]
    assert large and all(state.table_sizes[name] == hashed.table_sizes[name] for name in large)
    assert all(state.table_sizes[name] <= hashed.table_sizes[name] for name in state.table_sizes)
    raw = pq.read_table(tiny_warehouse / "day=2")
    features = pq.read_table(apply_state(managed, state, tiny_warehouse, tmp_path, 2), partitioning=None)
    assert np.array_equal(features["label"].to_numpy(), raw["label"].to_numpy())
    for name in SPARSE_COLUMNS:
        ids = raw[name].to_numpy(zero_copy_only=False).astype(np.float64)
        expected = np.where(np.isnan(ids), MISSING_ID, np.nan_to_num(ids).astype(np.int64))
        assert features.schema.field(name).type == pa.int64()
        assert np.array_equal(features[name].to_numpy(), expected), name


@pytest.mark.parametrize("mode", ["hash", "managed"])
def test_tables_sized_at_hash_size_leave_every_feature_its_full_table(tiny_warehouse: Path, tmp_path: Path,
                                                                      mode: str) -> None:  # fmt: skip
    """`table_rows = "hash_size"`: every table `hash_size` rows, however few ids a feature
    has (the default gives a 3-id feature a handful), and a state of its own; the ids still
    map as hash mode maps them (1 + v mod buckets)."""
    import dataclasses

    config = dataclasses.replace(TINY_PREPROCESS, categorical_mode=mode, table_rows="hash_size")
    state = fit_state(config, tiny_warehouse, tmp_path / "full", [0, 1])
    seen = fit_state(dataclasses.replace(config, table_rows="ids_seen"), tiny_warehouse, tmp_path / "seen", [0, 1])
    assert state.state_id != seen.state_id
    assert set(state.table_sizes.values()) == {TINY_PREPROCESS.hash_size}
    assert min(seen.table_sizes.values()) < TINY_PREPROCESS.hash_size, "the fixture has a feature with few ids"
    if mode == "hash":
        raw = pq.read_table(tiny_warehouse / "day=2")
        features = pq.read_table(apply_state(config, state, tiny_warehouse, tmp_path / "full", 2), partitioning=None)
        ids = raw["C1"].to_numpy(zero_copy_only=False).astype(np.float64)
        present = ~np.isnan(ids)
        expected = 1 + ids[present].astype(np.int64) % (TINY_PREPROCESS.hash_size - 1)
        assert np.array_equal(features["C1"].to_numpy()[present], expected)


def test_tables_sized_at_hash_size_are_not_a_vocab_mode_setting() -> None:
    from ingestion.config import PreprocessConfig

    with pytest.raises(ValueError, match="table_rows: .*vocab_headroom"):
        PreprocessConfig(categorical_mode="vocab", table_rows="hash_size")


def test_auto_mode_looks_few_rows_up_in_a_vocabulary_and_hashes_many() -> None:
    """`categorical_mode = "auto"` (the default) by the training rows: a vocabulary below
    `FEW_ROWS`, hash tables from there, and hash tables wherever `table_rows = "hash_size"`
    asks for full tables (a vocabulary sizes its own); a named mode is kept."""
    import dataclasses

    from ingestion.config import FEW_ROWS, PreprocessConfig

    auto = PreprocessConfig()
    assert auto.categorical_mode == "auto"
    assert [auto.mode_for(rows) for rows in (1, FEW_ROWS - 1, FEW_ROWS, 600_000)] == ["vocab", "vocab", "hash", "hash"]
    assert dataclasses.replace(auto, table_rows="hash_size").mode_for(100) == "hash"
    for mode in ("hash", "vocab", "managed"):
        assert dataclasses.replace(auto, categorical_mode=mode).mode_for(100) == mode
        assert dataclasses.replace(auto, categorical_mode=mode).mode_for(10**7) == mode


def test_auto_mode_on_the_tiny_days_is_the_vocabulary_state_with_its_id(tiny_warehouse: Path, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """12,000 training rows under `auto`: the state a config naming `vocab` fits, under the same
    id (so the run's resolved config, which names the mode, finds it), said in the log; an id
    the training days never saw maps to the out-of-vocabulary row 1, whose weight no training
    row moves, where hash mode gives it a seen id's row."""
    import dataclasses
    import logging

    auto = dataclasses.replace(TINY_PREPROCESS, categorical_mode="auto")
    vocab = dataclasses.replace(TINY_PREPROCESS, categorical_mode="vocab")
    with caplog.at_level(logging.INFO, logger="ingestion.preprocess"):
        state = fit_state(auto, tiny_warehouse, tmp_path, [0, 1])
    assert state.mode == "vocab" and state.train_rows == 12_000
    assert state.state_id == state_id_for(auto, tiny_warehouse, [0, 1]) == state_id_for(vocab, tiny_warehouse, [0, 1])
    assert state.state_id != state_id_for(TINY_PREPROCESS, tiny_warehouse, [0, 1])
    assert 'categorical_mode "auto": vocab (12,000 training rows are fewer than 32,768' in caplog.text
    train = pa.concat_tables([pq.read_table(tiny_warehouse / f"day={day}") for day in (0, 1)])
    raw = pq.read_table(tiny_warehouse / "day=2")
    features = pq.read_table(apply_state(auto, state, tiny_warehouse, tmp_path, 2), partitioning=None)
    whole = [c for c in SPARSE_COLUMNS if state.buckets[c] == len(set(train[c].drop_null().to_pylist()))]  # not capped
    column = max(whole, key=lambda c: len(set(raw[c].drop_null().to_pylist()) - set(train[c].to_pylist())))
    seen = set(train[column].drop_null().to_pylist())
    values = raw[column].to_pylist()
    unseen = np.array([v is not None and v not in seen for v in values])
    assert unseen.any(), "the evaluation day has ids the training days never saw"
    rows = features[column].to_numpy()
    assert (rows[unseen] == 1).all() and (rows[~unseen] != 1).all()
