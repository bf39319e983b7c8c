"""Multi-hot features end to end: raw bags → list columns → preprocessed bags → jagged KJTs."""

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ingestion.config import PreprocessConfig
from ingestion.preprocess import MISSING_ROW, OOV_ROW, apply_state, fit_state
from ingestion.raw_parse import parse_block
from ingestion.reader import PAD_LABEL, build_reader, first_ids
from ingestion.schema import SPARSE_COLUMNS
from ingestion.synthetic import generate_day
from ingestion.warehouse import ingest_day, read_manifest
from tests.conftest import TINY_MULTI_HOT, TINY_MULTI_HOT_SYNTHETIC

DENSE = "\t".join(["1"] * 13)


def _line(c3: str, c4: str = "0000000a") -> str:
    categorical = ["0000000a"] * 26
    categorical[2], categorical[3] = c3, c4
    return "1\t" + DENSE + "\t" + "\t".join(categorical)


def _bags(column) -> list[tuple[int, ...]]:
    """A list column as tuples; a null bag as ()."""
    return [tuple(bag) if bag is not None else () for bag in column.to_pylist()]


def test_bags_parse_to_id_lists_and_bad_bags_are_quarantined() -> None:
    good = ["0a1b2c3d,FFFFFFFF,0a1b2c3d", "", "00000001"]
    bad = {"0a1b2c3d,": "C3", "0a1b2c3,00000001": "C3", "0a1b2c3g": "C3", "0a1b2c3d;00000001": "C3"}
    lines = [_line(c3) for c3 in good] + [_line(c3) for c3 in bad]
    parsed = parse_block(("\n".join(lines) + "\n").encode(), 1, "s", multi_hot=("C3",))
    assert parsed.lines == parsed.rows.num_rows + parsed.quarantine.num_rows == len(lines)
    want = [tuple(int(x, 16) for x in field.split(",")) if field else () for field in good]
    assert _bags(parsed.rows["C3"]) == want
    assert parsed.rows["C3"].null_count == 1, "an empty field is a missing bag"
    assert parsed.quarantine["line"].to_pylist() == [4, 5, 6, 7]
    for reason, raw in zip(parsed.quarantine["reason"].to_pylist(), bad):
        assert reason.startswith("C3: ") and "list of 8-hex-character ids" in reason and raw in reason


def test_a_bag_in_a_feature_not_declared_multi_hot_is_quarantined() -> None:
    lines = [_line("0000000b", c4="0000000c,0000000d"), _line("0000000b,0000000c")]
    parsed = parse_block(("\n".join(lines) + "\n").encode(), 1, "s", multi_hot=("C3",))
    assert parsed.rows.num_rows == 1
    assert parsed.quarantine["reason"].to_pylist() == ["C4: '0000000c,0000000d' is not 8 hex characters"]


def test_generated_bags_ingest_as_list_columns(multi_hot_warehouse: Path) -> None:
    manifest = read_manifest(multi_hot_warehouse, 0)
    assert manifest["multi_hot"] == list(TINY_MULTI_HOT)
    assert manifest["rows_read"] == manifest["rows_written"] == TINY_MULTI_HOT_SYNTHETIC.rows_per_day
    table = pq.read_table(multi_hot_warehouse / "day=0")
    for name in SPARSE_COLUMNS:
        assert (str(table.schema.field(name).type) == "list<element: uint32>") == (name in TINY_MULTI_HOT), name
    lengths = np.array([len(bag) for bag in _bags(table["C3"]) if bag])
    # 1 + Poisson(mean − 1) ids per present bag
    assert lengths.min() >= 1 and lengths.mean() == pytest.approx(TINY_MULTI_HOT_SYNTHETIC.multi_hot_mean_ids, rel=0.05)
    assert lengths.max() > 6, "bags vary in size"


def test_reingesting_with_another_layout_redoes_the_day(tmp_path: Path) -> None:
    generate_day(TINY_MULTI_HOT_SYNTHETIC, 0, tmp_path / "raw", multi_hot=TINY_MULTI_HOT)
    source = [str(tmp_path / "raw" / "day_0.tsv.gz")]
    ingest_day(source, 0, tmp_path / "wh", multi_hot=TINY_MULTI_HOT)
    assert ingest_day(source, 0, tmp_path / "wh", multi_hot=TINY_MULTI_HOT).skipped
    single = ingest_day(source, 0, tmp_path / "wh")
    assert not single.skipped
    # Read as single-hot, rows whose bags hold several ids are bad rows, none is lost.
    assert single.rows_quarantined > 0
    assert single.rows_read == single.rows_written + single.rows_quarantined == TINY_MULTI_HOT_SYNTHETIC.rows_per_day


def _expected_hash_bag(bag: tuple[int, ...], buckets: int) -> tuple[int, ...]:
    return tuple(1 + v % buckets for v in bag) if bag else (MISSING_ROW,)


def test_hashed_bags_match_a_numpy_oracle(multi_hot_warehouse: Path, multi_hot_features) -> None:
    state, files = multi_hot_features
    raw = pq.read_table(multi_hot_warehouse / "day=2")
    features = pq.read_table(files[2], partitioning=None)
    assert features.num_rows == raw.num_rows

    def rows(table, transform) -> Counter:
        keys = zip(table["label"].to_pylist(), *(transform(name, table[name]) for name in SPARSE_COLUMNS))
        return Counter(keys)

    def expected(name: str, column) -> list:
        if name in TINY_MULTI_HOT:
            return [_expected_hash_bag(bag, state.buckets[name]) for bag in _bags(column)]
        ids = column.to_numpy(zero_copy_only=False).astype(np.float64)
        return [MISSING_ROW if np.isnan(v) else 1 + int(v) % state.buckets[name] for v in ids]

    def got(name: str, column) -> list:
        return _bags(column) if name in TINY_MULTI_HOT else column.to_pylist()

    assert rows(features, got) == rows(raw, expected), "every row, bags in their order"


def test_state_records_mean_ids_per_example(multi_hot_warehouse: Path, multi_hot_features) -> None:
    state, _ = multi_hot_features
    assert set(state.multi_hot) == set(TINY_MULTI_HOT)
    for name in TINY_MULTI_HOT:
        bags = [bag for day in (0, 1) for bag in _bags(pq.read_table(multi_hot_warehouse / f"day={day}")[name])]
        assert state.multi_hot[name] == pytest.approx(np.mean([max(len(b), 1) for b in bags]), abs=1e-4)


def test_vocabulary_bags_match_a_numpy_oracle(multi_hot_warehouse: Path, tmp_path: Path) -> None:
    config = PreprocessConfig(hash_size=400, categorical_mode="vocab", min_count=2, duckdb_threads=1, row_group_size=2048)
    state = fit_state(config, multi_hot_warehouse, tmp_path, (0, 1))
    day2 = pq.read_table(apply_state(config, state, multi_hot_warehouse, tmp_path, 2))
    for name in TINY_MULTI_HOT:
        bags = [bag for day in (0, 1) for bag in _bags(pq.read_table(multi_hot_warehouse / f"day={day}")[name])]
        counts = Counter(v for bag in bags for v in bag)
        kept = sorted((v for v, n in counts.items() if n >= 2), key=lambda v: (-counts[v], v))[: config.hash_size - 2]
        index = {v: i + 2 for i, v in enumerate(kept)}
        assert state.buckets[name] == len(kept)
        raw = _bags(pq.read_table(multi_hot_warehouse / "day=2")[name])
        want = Counter(tuple(index.get(v, OOV_ROW) for v in bag) if bag else (MISSING_ROW,) for bag in raw)
        assert Counter(_bags(day2[name])) == want, name


def _batch_rows(batches) -> list[tuple]:
    """Every non-padding example as (label, C1 id, C3 bag, C12 bag)."""
    rows = []
    for batch in batches:
        kjt = batch.sparse_features
        by_name = kjt.to_dict()
        bags = {name: [tuple(t.tolist()) for t in by_name[name].to_dense()] for name in TINY_MULTI_HOT}
        c1 = by_name["C1"].values().tolist()
        for i, label in enumerate(batch.labels.tolist()):
            if label != PAD_LABEL:
                rows.append((label, c1[i], bags["C3"][i], bags["C12"][i]))
    return rows


def _file_rows(files) -> list[tuple]:
    table = pq.read_table(files, partitioning=None)
    return list(zip(map(float, table["label"].to_pylist()), table["C1"].to_pylist(), _bags(table["C3"]), _bags(table["C12"])))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_cover_the_bags_exactly_once(multi_hot_features, world_size: int) -> None:
    _, files = multi_hot_features
    paths = files[0] + files[1]
    readers = [build_reader(paths, 300, rank, world_size, drop_remainder=False) for rank in range(world_size)]
    assert len({len(r) for r in readers}) == 1
    rows = [row for reader in readers for row in _batch_rows(reader)]
    assert sorted(rows) == sorted(_file_rows(paths))


def test_bags_are_jagged_in_the_kjt(multi_hot_features) -> None:
    state, files = multi_hot_features
    batch = next(iter(build_reader(files[2], 256)))
    kjt = batch.sparse_features
    assert kjt.keys() == list(SPARSE_COLUMNS) and kjt.stride() == 256
    lengths = kjt.to_dict()
    for name in SPARSE_COLUMNS:
        got = lengths[name].lengths()
        if name in TINY_MULTI_HOT:
            assert got.min() >= 1 and got.float().mean() > 2, "bags of several ids, none empty"
        else:
            assert got.tolist() == [1] * 256
        assert lengths[name].values().max() < state.table_sizes[name]
    firsts = first_ids(kjt, "C3").tolist()
    assert firsts == [bag[0] for bag in (tuple(t.tolist()) for t in lengths["C3"].to_dense())]


def test_shuffled_and_resumed_bags_replay_exactly(multi_hot_features) -> None:
    _, files = multi_hot_features
    paths = files[0] + files[1]
    whole = list(build_reader(paths, 500, 1, 2, shuffle_seed=4))
    resumed = list(build_reader(paths, 500, 1, 2, shuffle_seed=4, start_batch=2))
    assert _batch_rows(resumed) == _batch_rows(whole[2:])
    shuffled = _batch_rows(build_reader(paths, 500, shuffle_seed=4, drop_remainder=False))
    plain = _batch_rows(build_reader(paths, 500, drop_remainder=False))
    assert shuffled != plain and sorted(shuffled) == sorted(plain), "the same bags, in another order"


def test_padding_rows_hold_one_missing_id(multi_hot_features) -> None:
    _, files = multi_hot_features
    batches = list(build_reader(files[2], 3000, drop_remainder=False))
    last = batches[-1]
    padded = (last.labels == PAD_LABEL).nonzero().flatten()
    assert len(padded) == 2 * 3000 - 4000
    for name in TINY_MULTI_HOT:
        jagged = last.sparse_features[name]
        assert jagged.lengths()[padded].tolist() == [1] * len(padded)
        assert set(jagged.values()[jagged.offsets()[:-1][padded]].tolist()) == {0}
