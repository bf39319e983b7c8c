"""The user's own hive-partitioned Parquet as a source: validation, quarantine, counts,
schema changes, id types, and the features and served rows they become."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingestion.config import DataConfig, PreprocessConfig
from ingestion.days import parse_day
from ingestion.id_hash import hash_strings
from ingestion.parquet_source import SchemaChangeError, ingest_parquet_day
from ingestion.preprocess import apply_state, fit_state
from ingestion.reader import build_reader
from ingestion.warehouse import partition_dir, read_manifest
from training.codec import decode

DAYS = ("2026-11-20", "2026-11-21", "2026-11-22")


def source_config(root: Path | str, **changes) -> DataConfig:
    settings = {"source": "parquet", "path": str(root), "label": "clicked", "dense": ("price", "views"),
                "sparse": ("user_id", "item_id", "tags"), "train_days": DAYS[:2], "eval_days": DAYS[2:]}  # fmt: skip
    return decode(DataConfig, {**settings, **changes})


def day_table(seed: int, rows: int = 50) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = [f"user-{i}" for i in rng.integers(0, 7, rows)]
    users[3] = None
    tags = [[f"t{j}" for j in rng.integers(0, 5, rng.integers(0, 4))] for _ in range(rows)]
    tags[4], tags[5] = None, ["t1", None, "t2"]
    return pa.table({
        "clicked": pa.array(rng.integers(0, 2, rows), pa.int64()),
        "price": pa.array(rng.gamma(2.0, 3.0, rows)),
        "views": pa.array(rng.integers(-2, 50, rows), pa.int32()),
        "user_id": pa.array(users, pa.string()),
        "item_id": pa.array(rng.integers(-10**12, 10**12, rows), pa.int64()),
        "tags": pa.array(tags, pa.list_(pa.string())),
        "unused": pa.array(["x"] * rows),
    })  # fmt: skip


def write_day(root: Path, day: str, tables: list[pa.Table]) -> list[str]:
    folder = root / f"ds={day}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, table in enumerate(tables):
        pq.write_table(table, folder / f"part-{index:05d}.parquet", row_group_size=16)
        paths.append(str(folder / f"part-{index:05d}.parquet"))
    return paths


def with_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def test_bad_rows_are_quarantined_with_partition_file_row_and_reason(tmp_path: Path) -> None:
    table = day_table(1)
    labels = table["clicked"].to_pylist()
    labels[2], labels[7] = None, 3
    prices = table["price"].to_pylist()
    prices[9], prices[11], prices[12] = float("nan"), float("inf"), None  # a null price is only missing
    table = with_column(with_column(table, "clicked", pa.array(labels, pa.int64())), "price", pa.array(prices))
    files = write_day(tmp_path / "src", DAYS[0], [table, day_table(2)])
    config = source_config(tmp_path / "src")
    report = ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", config)
    assert [(f.rows_read, f.rows_written, f.rows_quarantined) for f in report.files] == [(50, 46, 4), (50, 50, 0)]
    quarantine = pq.read_table(tmp_path / "wh" / "_quarantine" / f"day={parse_day(DAYS[0])}").to_pylist()
    assert [(q["row"], q["reason"]) for q in quarantine] == [
        (2, "clicked is null"), (7, "clicked is 3, not 0 or 1"), (9, "price is not finite"), (11, "price is not finite"),
    ]  # fmt: skip
    assert {q["partition"] for q in quarantine} == {f"ds={DAYS[0]}"} and {q["source"] for q in quarantine} == {files[0]}
    assert json.loads(quarantine[1]["values"])["user_id"] == table["user_id"][7].as_py()
    manifest = read_manifest(tmp_path / "wh", parse_day(DAYS[0]))
    assert manifest["rows_read"] == manifest["rows_written"] + manifest["rows_quarantined"] == 100
    written = pq.read_table(partition_dir(tmp_path / "wh", parse_day(DAYS[0])))
    assert written.num_rows == 96 and "unused" not in written.column_names


def test_ids_become_int64_text_hashed_lists_without_null_ids(tmp_path: Path) -> None:
    table = day_table(3)
    files = write_day(tmp_path / "src", DAYS[0], [table])
    ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", source_config(tmp_path / "src"))
    written = pq.read_table(partition_dir(tmp_path / "wh", parse_day(DAYS[0])))
    assert written.schema.field("user_id").type == pa.int64() and written.schema.field("tags").type == pa.list_(pa.int64())
    assert written["user_id"].to_pylist() == hash_strings(table["user_id"].combine_chunks()).to_pylist()
    assert written["item_id"].to_pylist() == table["item_id"].to_pylist(), "integer ids are kept as they are"
    assert written["tags"][4].as_py() is None
    assert written["tags"][5].as_py() == hash_strings(pa.array(["t1", "t2"])).to_pylist(), "a null id in a bag is dropped"
    layout = read_manifest(tmp_path / "wh", parse_day(DAYS[0]))["layout"]
    assert layout == {"dense": ["price", "views"], "sparse": ["user_id", "item_id", "tags"], "multi_hot": ["tags"],
                      "id_types": {"user_id": "string", "item_id": "int", "tags": "string"}}  # fmt: skip


def test_fractional_ids_in_a_float_id_column_are_quarantined(tmp_path: Path) -> None:
    """pandas writes an integer column with nulls as float64: whole numbers are ids."""
    table = day_table(4)
    items = [float(i % 5) for i in range(50)]
    items[6], items[8] = 2.5, None
    files = write_day(tmp_path / "src", DAYS[0], [with_column(table, "item_id", pa.array(items))])
    report = ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", source_config(tmp_path / "src"))
    assert (report.rows_written, report.rows_quarantined) == (49, 1)
    quarantine = pq.read_table(tmp_path / "wh" / "_quarantine" / f"day={parse_day(DAYS[0])}").to_pylist()
    assert [(q["row"], q["reason"]) for q in quarantine] == [(6, "item_id is not an integer id")]


def test_a_retyped_column_stops_the_day_naming_it_and_both_types(tmp_path: Path) -> None:
    config = source_config(tmp_path / "src")
    first = write_day(tmp_path / "src", DAYS[0], [day_table(5)])
    ingest_parquet_day(first, parse_day(DAYS[0]), tmp_path / "wh", config)
    before = (partition_dir(tmp_path / "wh", parse_day(DAYS[0])) / "_manifest.json").read_text()
    retyped = with_column(day_table(6), "item_id", pa.array([f"i{i}" for i in range(50)]))
    second = write_day(tmp_path / "src", DAYS[1], [retyped])
    with pytest.raises(SchemaChangeError) as stopped:
        ingest_parquet_day(second, parse_day(DAYS[1]), tmp_path / "wh", config)
    message = str(stopped.value)
    assert "'item_id'" in message and "string" in message and "int64" in message and f"ds={DAYS[0]}" in message
    assert "\n" not in message
    assert not partition_dir(tmp_path / "wh", parse_day(DAYS[1])).exists(), "nothing of the day is published"
    assert (partition_dir(tmp_path / "wh", parse_day(DAYS[0])) / "_manifest.json").read_text() == before


def test_a_missing_column_or_one_of_an_unusable_type_is_named(tmp_path: Path) -> None:
    config = source_config(tmp_path / "src")
    files = write_day(tmp_path / "src", DAYS[0], [day_table(7).drop(["views"])])
    with pytest.raises(SchemaChangeError, match="has no column 'views' \\(data.dense\\)"):
        ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", config)
    files = write_day(tmp_path / "src", DAYS[1], [with_column(day_table(7), "clicked", pa.array([0.0] * 50))])
    with pytest.raises(SchemaChangeError, match="column 'clicked' is double, but data.label needs bool or integer"):
        ingest_parquet_day(files, parse_day(DAYS[1]), tmp_path / "wh", config)


def test_files_of_one_day_must_agree(tmp_path: Path) -> None:
    scalar_tags = with_column(day_table(9), "tags", pa.array(["t1"] * 50))
    files = write_day(tmp_path / "src", DAYS[0], [day_table(8), scalar_tags])
    with pytest.raises(SchemaChangeError, match="'tags' is string in .*part-00001.parquet, but list<element: string> in "
                                                "the day's other files"):  # fmt: skip
        ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", source_config(tmp_path / "src"))


def test_widening_an_integer_column_is_no_schema_change(tmp_path: Path) -> None:
    config = source_config(tmp_path / "src")
    ingest_parquet_day(write_day(tmp_path / "src", DAYS[0], [day_table(10)]), parse_day(DAYS[0]), tmp_path / "wh", config)
    narrow = with_column(day_table(11), "views", pa.array(range(50), pa.int8()))
    report = ingest_parquet_day(write_day(tmp_path / "src", DAYS[1], [narrow]), parse_day(DAYS[1]), tmp_path / "wh", config)
    assert report.rows_written == 50


def test_an_unchanged_day_is_not_ingested_again(tmp_path: Path) -> None:
    config = source_config(tmp_path / "src")
    files = write_day(tmp_path / "src", DAYS[0], [day_table(12)])
    assert not ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", config).skipped
    assert ingest_parquet_day(files, parse_day(DAYS[0]), tmp_path / "wh", config).skipped


def test_features_use_the_column_names_and_signed_ids_land_in_their_tables(tmp_path: Path) -> None:
    config = source_config(tmp_path / "src")
    warehouse, features = tmp_path / "wh", tmp_path / "features"
    for seed, day in enumerate(DAYS):
        ingest_parquet_day(write_day(tmp_path / "src", day, [day_table(20 + seed, 400)]), parse_day(day), warehouse, config)
    for mode in ("hash", "vocab"):
        preprocess = PreprocessConfig(hash_size=64, categorical_mode=mode, duckdb_threads=1, row_group_size=1024)
        state = fit_state(preprocess, warehouse, features, config.train_days)
        assert list(state.buckets) == ["user_id", "item_id", "tags"] and state.dense == ("price", "views")
        assert set(state.multi_hot) == {"tags"}
        folder = apply_state(preprocess, state, warehouse, features, config.eval_days[0])
        table = pq.read_table(folder)
        assert table.column_names == ["label", "price", "views", "user_id", "item_id", "tags"]
        sizes = state.table_sizes
        for name in ("user_id", "item_id"):
            rows = table[name].to_numpy()
            assert rows.min() >= 0 and rows.max() < sizes[name], (mode, name)
        assert (table["user_id"].to_numpy() == 0).sum() == 1, "the one null user is the missing row"
        tags = table["tags"].combine_chunks()
        assert tags.flatten().to_numpy().max() < sizes["tags"]
        batch = next(iter(build_reader(sorted(map(str, folder.glob("*.parquet"))), 32)))
        assert batch.sparse_features.keys() == ["user_id", "item_id", "tags"] and batch.dense_features.shape == (32, 2)


def test_hash_mode_maps_negative_ids_like_numpy(tmp_path: Path) -> None:
    """The SQL's remainder is made non-negative: the served model's `np.mod` gives the same row."""
    config = source_config(tmp_path / "src")
    warehouse, features = tmp_path / "wh", tmp_path / "features"
    for seed, day in enumerate(DAYS):
        ingest_parquet_day(write_day(tmp_path / "src", day, [day_table(30 + seed, 200)]), parse_day(day), warehouse, config)
    preprocess = PreprocessConfig(hash_size=1000, categorical_mode="hash", duckdb_threads=1, row_group_size=1024)
    state = fit_state(preprocess, warehouse, features, config.train_days)
    raw = pq.read_table(partition_dir(warehouse, config.eval_days[0]))
    rows = pq.read_table(apply_state(preprocess, state, warehouse, features, config.eval_days[0]))
    items = raw["item_id"].to_numpy()
    assert (items < 0).any()
    assert rows["item_id"].to_numpy().tolist() == (1 + np.mod(items, state.buckets["item_id"])).tolist()


def test_a_dataset_behind_a_url_is_read_through_fsspec(tmp_path: Path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    for seed, day in enumerate(DAYS[:2]):
        with memory.open(f"/clicks/ds={day}/part-00000.parquet", "wb") as handle:
            pq.write_table(day_table(40 + seed), handle)
        memory.touch(f"/clicks/ds={day}/_SUCCESS")
    config = source_config("memory://clicks")
    from flows.run.sources import complete_days, partition_files

    pipeline = _pipeline(tmp_path, config)
    files = partition_files(pipeline)
    assert sorted(files) == [parse_day(day) for day in DAYS[:2]]
    assert files[parse_day(DAYS[0])] == [f"memory:///clicks/ds={DAYS[0]}/part-00000.parquet"]
    report = ingest_parquet_day(files[parse_day(DAYS[0])], parse_day(DAYS[0]), tmp_path / "wh", config)
    assert report.rows_written == 50 and not report.files_failed
    marked = _pipeline(tmp_path, source_config("memory://clicks", complete_marker="_SUCCESS"))
    assert complete_days(marked) == [parse_day(day) for day in DAYS[:2]]
    memory.rm("/clicks", recursive=True)


def test_an_unreadable_file_stops_the_day_naming_it(tmp_path: Path) -> None:
    from ingestion.warehouse import SourceReadError

    files = write_day(tmp_path / "src", DAYS[0], [day_table(50)])
    broken = tmp_path / "src" / f"ds={DAYS[0]}" / "part-00001.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(SourceReadError, match="part-00001.parquet: cannot read its Parquet footer"):
        ingest_parquet_day([*files, str(broken)], parse_day(DAYS[0]), tmp_path / "wh", source_config(tmp_path / "src"))
    assert not partition_dir(tmp_path / "wh", parse_day(DAYS[0])).exists()


def test_a_configured_day_without_its_partition_is_one_line_naming_it(tmp_path: Path) -> None:
    from flows.run.config import ConfigError
    from flows.run.sources import partition_files, raw_sources

    for seed, day in enumerate(DAYS[:2]):
        write_day(tmp_path / "src", day, [day_table(60 + seed)])
    (tmp_path / "src" / "ds=__HIVE_DEFAULT_PARTITION__").mkdir()
    config = _pipeline(tmp_path, source_config(tmp_path / "src"))
    with pytest.raises(ConfigError, match=f"no partition ds={DAYS[2]} .* \\(the newest there: ds={DAYS[0]}, ds={DAYS[1]}\\)"):
        raw_sources(config)
    assert sorted(partition_files(config, [parse_day(DAYS[1])])) == [parse_day(DAYS[1])], "only the days asked for"


def _pipeline(run_dir: Path, data: DataConfig):
    from evaluation.config import EvaluationConfig
    from flows.run.config import PipelineConfig

    return PipelineConfig(run_dir=str(run_dir), data=data, evaluation=EvaluationConfig(slice_feature=data.sparse[0]))
