"""The user's own Parquet warehouse → this pipeline's warehouse, validated like raw logs.

A source is a hive-partitioned dataset (`ds=2026-11-24/part-*.parquet`) with its own column
names: a 0/1 label (bool or integer), numeric dense columns, and id columns holding integer
or string ids, or lists of them (multi-hot). A day is one partition; only its files are
read (partition pruning), each streamed in record batches of its configured columns only,
so memory stays flat however many days the dataset holds.

Each row becomes a warehouse row: `label` (int8), the dense columns as float64 (null:
missing), the id columns as int64 ids (text ids as the FNV-1a hash of their UTF-8 bytes:
ingestion/id_hash.py; lists with their null ids dropped). A row with a null or non-0/1
label, a non-finite dense value, or a fractional id in a float-typed id column is
quarantined with its partition, file, row and reason; per file, rows read = written +
quarantined.

A file whose columns differ from the day's other files or from the days ingested before
(a column missing, or of another kind: integer ids turned text, a list turned scalar) stops
the day with `SchemaChangeError`, naming the column and both types, before anything is
published: the earlier days stay as they were, and so does every model trained on them.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ingestion.config import DataConfig
from ingestion.file_digest import content_digest
from ingestion.id_hash import hash_strings
from ingestion.schema import SCHEMA_VERSION, FeatureLayout
from ingestion.staging import new_staging
from ingestion.warehouse import (
    DayReport,
    FileReport,
    ParquetSink,
    SourceReadError,
    fingerprint,
    partition_dir,
    publish,
    read_manifest,
    write_manifest,
)

log = logging.getLogger(__name__)
BATCH_ROWS = 65_536
QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("partition", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),  # 0-based, within the file
        pa.field("reason", pa.string(), nullable=False),
        pa.field("values", pa.string(), nullable=False),  # the row's configured columns, as JSON
    ]
)


class SchemaChangeError(ValueError):
    """A file whose columns are not those of the day's other files or earlier days."""


@dataclass(frozen=True)
class ColumnKind:
    """How a source column is read: its family and, for id columns, list or not."""

    family: str  # "label" | "dense" | "int" | "float-id" | "string"
    is_list: bool = False
    arrow_type: str = ""

    def same_as(self, other: ColumnKind) -> bool:
        """Kinds that give the same warehouse column (int32 → int64 is no change)."""
        def family(kind: ColumnKind) -> str:
            return "int" if kind.family == "float-id" else kind.family

        return family(self) == family(other) and self.is_list == other.is_list


def column_kinds(schema: pa.Schema, data: DataConfig, where: str) -> dict[str, ColumnKind]:
    """Each configured column's kind in a file's schema; a missing or unusable column raises."""
    kinds = {}
    wanted = {data.label: "label", **{c: "dense" for c in data.dense}, **{c: "sparse" for c in data.sparse}}
    for name, role in wanted.items():
        index = schema.get_field_index(name)
        if index < 0:
            raise SchemaChangeError(f"{where}: has no column {name!r} (data.{role}); columns there: "
                                    f"{', '.join(schema.names)}")  # fmt: skip
        kinds[name] = _kind(schema.field(index).type, role, name, where)
    return kinds


def _kind(arrow_type: pa.DataType, role: str, name: str, where: str) -> ColumnKind:
    shown = str(arrow_type)
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    if role == "label" and (pa.types.is_boolean(arrow_type) or pa.types.is_integer(arrow_type)):
        return ColumnKind("label", arrow_type=shown)
    if role == "dense" and (pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
                            or pa.types.is_boolean(arrow_type) or pa.types.is_decimal(arrow_type)):  # fmt: skip
        return ColumnKind("dense", arrow_type=shown)
    if role == "sparse":
        is_list = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
        item = arrow_type.value_type if is_list else arrow_type
        if pa.types.is_dictionary(item):
            item = item.value_type
        if pa.types.is_integer(item):
            return ColumnKind("int", is_list, shown)
        if pa.types.is_floating(item) and not is_list:
            return ColumnKind("float-id", is_list, shown)
        if pa.types.is_string(item) or pa.types.is_large_string(item) or pa.types.is_binary(item):
            return ColumnKind("string", is_list, shown)
    wanted = {"label": "bool or integer 0/1", "dense": "numeric",
              "sparse": "integer or string ids, or a list of them"}[role]  # fmt: skip
    raise SchemaChangeError(f"{where}: column {name!r} is {shown}, but data.{role} needs {wanted}")


def layout_of(kinds: dict[str, ColumnKind], data: DataConfig) -> FeatureLayout:
    return FeatureLayout(
        dense=tuple(data.dense),
        sparse=tuple(data.sparse),
        multi_hot=tuple(c for c in data.sparse if kinds[c].is_list),
        id_types={c: "string" if kinds[c].family == "string" else "int" for c in data.sparse},
    )


def layout_schema(layout: FeatureLayout) -> pa.Schema:
    """The warehouse rows of a Parquet source: label int8, dense float64, ids int64 (lists of them)."""
    ids = {name: pa.list_(pa.int64()) if name in layout.multi_hot else pa.int64() for name in layout.sparse}
    return pa.schema([pa.field("label", pa.int8(), nullable=False)]
                     + [pa.field(name, pa.float64()) for name in layout.dense]
                     + [pa.field(name, ids[name]) for name in layout.sparse])  # fmt: skip


def ingest_parquet_day(files: Sequence[str], day: int, warehouse: Path, data: DataConfig, force: bool = False) -> DayReport:
    """Ingest one partition's files; publish the day only when every file was read."""
    value = data.shown(day)
    partition = f"{data.partition}={value}"
    kinds_by_file = _checked_kinds(files, day, warehouse, data, partition)
    kinds = kinds_by_file[0]
    layout = layout_of(kinds, data)
    extra = {"source": "parquet", "layout": layout.as_dict(), "partition": partition,
             "source_types": {name: kind.arrow_type for name, kind in kinds.items()},
             "source_kinds": {name: [kind.family, kind.is_list] for name, kind in kinds.items()}}  # fmt: skip
    warehouse.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(warehouse, day)
    if not force and manifest and _same_ingest(manifest, files, extra):
        log.info("day %s: already ingested from the same files, skipping", value)
        return DayReport(day, [FileReport(**f) for f in manifest["files"]], layout.multi_hot, skipped=True)
    staging = new_staging(warehouse / "_tmp", f"day={day}")
    report = DayReport(day, multi_hot=layout.multi_hot)
    try:
        for index, (source, file_kinds) in enumerate(zip(files, kinds_by_file, strict=True)):
            report.files.append(_ingest_file(source, day, staging, index, file_kinds, layout, partition))
        if report.files_failed:  # a day is all its files or none: whatever partition was there stays
            raise SourceReadError(f"{report.files_failed[0].error}; {partition} was not ingested")
        write_manifest(staging / "data", report, extra)
        publish(staging / "data", partition_dir(warehouse, day), staging)
        publish(staging / "quarantine", warehouse / "_quarantine" / f"day={day}", staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


def _checked_kinds(files: Sequence[str], day: int, warehouse: Path, data: DataConfig,
                   partition: str) -> list[dict[str, ColumnKind]]:  # fmt: skip
    """Each file's column kinds, which must agree with the day's other files and the days
    before (an int32 file beside an int64 one, or a float id column beside an integer one,
    agree: they give the same warehouse column)."""
    if not files:
        raise SourceReadError(f"{partition}: no Parquet files")
    kinds: dict[str, ColumnKind] = {}
    earlier = _earlier_kinds(warehouse, day)
    per_file = []
    for source in files:
        found = column_kinds(_schema(source), data, f"{partition}: {source}")
        per_file.append(found)
        for name, kind in found.items():
            before, seen_where = (kinds[name], "the day's other files") if name in kinds else (
                earlier[1].get(name), f"the earlier day {earlier[0]}") if earlier else (None, "")  # fmt: skip
            if before is not None and not kind.same_as(before):
                raise SchemaChangeError(
                    f"{partition}: column {name!r} is {kind.arrow_type} in {source}, but {before.arrow_type} in "
                    f"{seen_where}; the day was not ingested (earlier days and models are unchanged): restore the "
                    "column's type, or start a new warehouse and model for the new schema")  # fmt: skip
            kinds.setdefault(name, kind)
    return per_file


def _earlier_kinds(warehouse: Path, day: int) -> tuple[str, dict[str, ColumnKind]] | None:
    """The column kinds of the newest ingested day before `day` (else the oldest after it)."""
    days = sorted(int(p.name.removeprefix("day=")) for p in warehouse.glob("day=*") if p.name[4:].isdigit())
    for other in [d for d in reversed(days) if d < day] + [d for d in days if d > day]:
        manifest = read_manifest(warehouse, other)
        if manifest and manifest.get("source") == "parquet":
            kinds = {name: ColumnKind(family, is_list, manifest["source_types"][name])
                     for name, (family, is_list) in manifest["source_kinds"].items()}  # fmt: skip
            return manifest["partition"], kinds
    return None


def _schema(source: str) -> pa.Schema:
    try:
        with fsspec.open(source, "rb") as handle:
            return pq.read_schema(handle)
    except (OSError, pa.ArrowInvalid) as error:
        raise SourceReadError(f"{source}: cannot read its Parquet footer: {error}") from None


def _same_ingest(manifest: dict, files: Sequence[str], extra: dict) -> bool:
    return (manifest.get("schema_version") == SCHEMA_VERSION and manifest.get("layout") == extra["layout"]
            and not any(f.get("error") for f in manifest["files"])
            and manifest["source_fingerprints"] == [fingerprint(s) for s in files])  # fmt: skip


def _ingest_file(source: str, day: int, staging: Path, index: int, kinds: dict[str, ColumnKind],
                 layout: FeatureLayout, partition: str) -> FileReport:  # fmt: skip
    report = FileReport(source=source, day=day)
    started = time.perf_counter()
    (staging / "data").mkdir(parents=True, exist_ok=True)
    (staging / "quarantine").mkdir(parents=True, exist_ok=True)
    data_path = staging / "data" / f"part-{index:05d}.parquet"
    quarantine_path = staging / "quarantine" / f"part-{index:05d}.parquet"
    try:
        with fsspec.open(source, "rb") as handle, ParquetSink(data_path, layout_schema(layout)) as rows_out, \
                ParquetSink(quarantine_path, QUARANTINE_SCHEMA) as bad_out:  # fmt: skip
            parquet = pq.ParquetFile(handle)
            report.size_bytes = parquet.metadata.serialized_size
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=list(kinds)):
                good, bad = validate_batch(pa.Table.from_batches([batch]), kinds, layout, report.rows_read, partition, source)
                rows_out.write(good)
                bad_out.write(bad)
                report.rows_read += batch.num_rows
                report.rows_written += good.num_rows
                report.rows_quarantined += bad.num_rows
            log.info("%s: %s: %s rows read, %s quarantined", partition, Path(source).name, f"{report.rows_read:,}",
                     f"{report.rows_quarantined:,}")  # fmt: skip
        report.sha256, report.size_bytes = content_digest(source)
    except (OSError, pa.ArrowInvalid) as error:
        report.error = f"{source}: cannot read: {error}"
        report.rows_read = report.rows_written = report.rows_quarantined = 0
        log.error("%s", report.error)
    assert report.error or report.rows_read == report.rows_written + report.rows_quarantined
    report.seconds = time.perf_counter() - started
    return report


def validate_batch(table: pa.Table, kinds: dict[str, ColumnKind], layout: FeatureLayout, first_row: int,
                   partition: str, source: str) -> tuple[pa.Table, pa.Table]:  # fmt: skip
    """(warehouse rows, quarantined rows) of one batch; each bad row keeps its first reason."""
    rows = table.num_rows
    reasons = np.full(rows, "", dtype=object)
    bad = np.zeros(rows, bool)

    def flag(mask: np.ndarray, reason: str | np.ndarray) -> None:
        fresh = mask & ~bad
        reasons[fresh] = reason[fresh] if isinstance(reason, np.ndarray) else reason
        bad[fresh] = True

    label_name = next(name for name, kind in kinds.items() if kind.family == "label")
    label_null = table[label_name].is_null().to_numpy(zero_copy_only=False)
    flag(label_null, f"{label_name} is null")
    label = pc.fill_null(pc.cast(table[label_name], pa.int64()), 0).to_numpy(zero_copy_only=False)
    wrong = (label != 0) & (label != 1)
    if wrong.any():
        texts = np.full(rows, None, dtype=object)
        texts[wrong] = [f"{label_name} is {value}, not 0 or 1" for value in label[wrong]]
        flag(wrong, texts)
    columns: dict[str, pa.Array] = {"label": pa.array(label.astype(np.int8))}
    for name in layout.dense:
        values = pc.cast(table[name], pa.float64()).combine_chunks()
        numbers = values.to_numpy(zero_copy_only=False)
        flag(values.is_valid().to_numpy(zero_copy_only=False) & ~np.isfinite(numbers), f"{name} is not finite")
        columns[name] = values
    for name in layout.sparse:
        columns[name], fractional = _ids(table[name].combine_chunks(), kinds[name])
        flag(fractional, f"{name} is not an integer id")
    good = pa.table(columns, schema=layout_schema(layout)).filter(pa.array(~bad))
    return good, _quarantine(table, np.flatnonzero(bad), reasons, first_row, partition, source)


def _ids(column: pa.Array, kind: ColumnKind) -> tuple[pa.Array, np.ndarray]:
    """A source id column → int64 ids (lists: list<int64> without null ids), and which rows
    hold a fractional id."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if kind.is_list:
        column = column.cast(pa.list_(column.type.value_type)) if pa.types.is_large_list(column.type) else column
        flat = column.flatten()
        flat = flat.dictionary_decode() if pa.types.is_dictionary(flat.type) else flat
        ids = hash_strings(flat) if kind.family == "string" else pc.cast(flat, pa.int64())
        keep = ids.is_valid().to_numpy(zero_copy_only=False)
        owner = np.repeat(np.arange(len(column)), pc.list_value_length(column).fill_null(0).to_numpy())
        counts = np.bincount(owner[keep], minlength=len(column))
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        values = pc.filter(ids, pa.array(keep))
        lists = pa.ListArray.from_arrays(pa.array(offsets), values, mask=column.is_null())
        return lists, np.zeros(len(column), bool)
    if kind.family == "string":
        return hash_strings(column), np.zeros(len(column), bool)
    if kind.family == "float-id":
        numbers = column.to_numpy(zero_copy_only=False)
        fractional = column.is_valid().to_numpy(zero_copy_only=False) & (~np.isfinite(numbers) | (numbers != np.round(numbers)))
        whole = np.where(fractional | ~np.isfinite(numbers), 0, numbers).astype(np.int64)
        return pa.array(whole, pa.int64(), mask=column.is_null().to_numpy(zero_copy_only=False)), fractional
    return pc.cast(column, pa.int64()), np.zeros(len(column), bool)


def _quarantine(table: pa.Table, rows: np.ndarray, reasons: np.ndarray, first_row: int, partition: str,
                source: str) -> pa.Table:  # fmt: skip
    if not len(rows):
        return QUARANTINE_SCHEMA.empty_table()
    bad = table.take(pa.array(rows)).to_pylist()
    values = [json.dumps(row, default=str) for row in bad]
    return pa.table({"partition": [partition] * len(rows), "source": [source] * len(rows),
                     "row": (rows + first_row).astype(np.int64), "reason": list(reasons[rows]), "values": values},
                    schema=QUARANTINE_SCHEMA)  # fmt: skip
