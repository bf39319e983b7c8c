"""Raw Criteo files → hive-partitioned Parquet warehouse, with quarantine and manifests.

Layout under the warehouse root:

    day=N/part-00000.parquet ...   typed rows (`warehouse_schema`), zstd, streaming row groups
    day=N/_manifest.json           sources, sha256, rows read / written / quarantined
    _quarantine/day=N/*.parquet    bad lines with source, line number, reason and raw bytes

A day is written into `_tmp/` and renamed into place, so a reader sees the old partition or
the new one, never half of one. Re-ingesting a day replaces it. Files names starting with
`_` are skipped by Arrow and DuckDB dataset discovery, which keeps manifests out of the data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from ingestion.prefetch import prefetched
from ingestion.raw_parse import parse_block
from ingestion.schema import QUARANTINE_SCHEMA, SCHEMA_VERSION, check_multi_hot, warehouse_schema
from ingestion.staging import new_staging

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 4 << 20  # compressed bytes per read: keeps the decompressor's output small
PARSE_BLOCK_BYTES = 32 << 20  # text per parsed block, ~130k Criteo lines
PREFETCH_BLOCKS = 2  # blocks decompressed ahead of the parser, in a background thread
ROW_GROUP_ROWS = 131_072
_DAY_IN_NAME = re.compile(r"day_(\d+)")


class SourceReadError(RuntimeError):
    """A raw file could not be read to its end (missing, unreadable, truncated)."""


@dataclass
class FileReport:
    source: str
    day: int
    rows_read: int = 0
    rows_written: int = 0
    rows_quarantined: int = 0
    sha256: str = ""
    size_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class DayReport:
    day: int
    files: list[FileReport] = field(default_factory=list)
    multi_hot: tuple[str, ...] = ()
    skipped: bool = False  # the manifest showed the same sources were already ingested

    @property
    def rows_read(self) -> int:
        return sum(f.rows_read for f in self.files if f.error is None)

    @property
    def rows_written(self) -> int:
        return sum(f.rows_written for f in self.files if f.error is None)

    @property
    def rows_quarantined(self) -> int:
        return sum(f.rows_quarantined for f in self.files if f.error is None)

    @property
    def files_failed(self) -> list[FileReport]:
        return [f for f in self.files if f.error is not None]


def day_of(source: str, position: int) -> int:
    """The day a file holds: `day_N` in its name or its folder's, else its position in the list."""
    path = Path(source)
    match = _DAY_IN_NAME.search(path.name) or _DAY_IN_NAME.search(path.parent.name)
    return int(match.group(1)) if match else position


def partition_dir(warehouse: Path, day: int) -> Path:
    return warehouse / f"day={day}"


def read_manifest(warehouse: Path, day: int) -> dict | None:
    path = partition_dir(warehouse, day) / "_manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


class EmptyDayError(ValueError):
    """A day whose sources hold no lines at all, refused (shown as one line)."""


def ingest_day(
    sources: Sequence[str], day: int, warehouse: Path, force: bool = False, multi_hot: Sequence[str] = (),
    allow_empty: bool = True,
) -> DayReport:
    """Ingest the raw files of one day; publish the partition if at least one file was read.

    `multi_hot`: the features whose raw field is a comma-separated list of ids.
    `allow_empty`: sources with no lines at all publish an empty partition, with a warning;
    False: they raise `EmptyDayError` and nothing is published.
    """
    multi_hot = check_multi_hot(multi_hot)
    warehouse.mkdir(parents=True, exist_ok=True)
    if not force and _already_ingested(sources, day, warehouse, multi_hot):
        log.debug("day %d: already ingested from the same sources, skipping", day)
        manifest = read_manifest(warehouse, day) or {}
        return DayReport(day, [FileReport(**f) for f in manifest.get("files", [])], multi_hot, skipped=True)
    staging = new_staging(warehouse / "_tmp", f"day={day}")
    report = DayReport(day, multi_hot=multi_hot)
    try:
        for index, source in enumerate(sources):
            report.files.append(_ingest_file(source, day, staging, index, multi_hot))
        if len(report.files_failed) == len(report.files):
            return report  # nothing readable: keep whatever partition was there
        if not allow_empty and not report.files_failed and report.rows_read == 0:
            raise EmptyDayError(f"day {day}: no lines in {', '.join(sources)}; nothing was published. Check the "
                                "source files, or pass --allow-empty to publish an empty day")  # fmt: skip
        write_manifest(staging / "data", report)
        publish(staging / "data", partition_dir(warehouse, day), staging)
        publish(staging / "quarantine", warehouse / "_quarantine" / f"day={day}", staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):  # the staging root, unless another ingest is using it
            staging.parent.rmdir()
    if not report.files_failed and report.rows_read == 0:
        log.warning("day %d: no lines in %s: published an empty partition; check the source files",
                    day, ", ".join(sources))  # fmt: skip
    return report


def _ingest_file(source: str, day: int, staging: Path, index: int, multi_hot: tuple[str, ...]) -> FileReport:
    report = FileReport(source=source, day=day)
    started = time.perf_counter()
    data_dir, quarantine_dir = staging / "data", staging / "quarantine"
    data_dir.mkdir(parents=True, exist_ok=True)
    quarantine_dir.mkdir(parents=True, exist_ok=True)
    data_path = data_dir / f"part-{index:05d}.parquet"
    quarantine_path = quarantine_dir / f"part-{index:05d}.parquet"
    digest = hashlib.sha256()
    try:
        with ParquetSink(data_path, warehouse_schema(multi_hot)) as rows_out, ParquetSink(
            quarantine_path, QUARANTINE_SCHEMA
        ) as bad_out:
            next_line = 1
            # zlib, sha256 and the Parquet writer release the GIL: reading runs in a thread
            # ahead of the parser and writing behind it, so a second core is used.
            blocks = prefetched(_read_line_blocks(source, digest, report), PREFETCH_BLOCKS, name="ingest-read")
            for block in blocks:
                parsed = parse_block(block, next_line, source, multi_hot)
                next_line += parsed.lines
                rows_out.write(parsed.rows)
                bad_out.write(parsed.quarantine)
                report.rows_read += parsed.lines
                report.rows_written += parsed.rows.num_rows
                report.rows_quarantined += parsed.quarantine.num_rows
                log.info(
                    "day %d: %s: %s rows read, %s quarantined",
                    day, Path(source).name, f"{report.rows_read:,}", f"{report.rows_quarantined:,}",
                )  # fmt: skip
    except SourceReadError as error:
        report.error = str(error)
        data_path.unlink(missing_ok=True)
        quarantine_path.unlink(missing_ok=True)
        # its rows are in neither the partition nor the quarantine: the manifest counts none
        report.rows_read = report.rows_written = report.rows_quarantined = 0
        log.error("%s", error)
    assert report.error or report.rows_read == report.rows_written + report.rows_quarantined
    report.sha256 = digest.hexdigest()
    report.seconds = time.perf_counter() - started
    return report


UTF8_BOM = b"\xef\xbb\xbf"


def _read_line_blocks(source: str, digest: hashlib._Hash, report: FileReport) -> Iterator[bytes]:
    """Whole-line blocks of the decompressed file, about `PARSE_BLOCK_BYTES` each; gzip is
    detected by its magic bytes."""
    try:
        raw = fsspec.open(source, "rb").open()
    except (OSError, ValueError) as error:
        raise SourceReadError(f"{source}: cannot open: {error}") from None
    with raw:
        decompressor: zlib._Decompress | None = None
        pending: list[bytes] = []
        pending_bytes = 0
        lines_done = 0
        first_block = True
        while True:
            try:
                chunk = raw.read(READ_CHUNK_BYTES)
            except OSError as error:
                raise SourceReadError(f"{source}: read failed after {report.size_bytes:,} bytes: {error}") from None
            if chunk:
                digest.update(chunk)
                report.size_bytes += len(chunk)
                if decompressor is None:
                    gzipped = chunk[:2] == b"\x1f\x8b"
                    decompressor = zlib.decompressobj(wbits=31) if gzipped else None
                if decompressor is not None:
                    chunk, decompressor = _decompress(decompressor, chunk, source, report, lines_done)
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes < PARSE_BLOCK_BYTES:
                    continue
            data = b"".join(pending)
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            pending, pending_bytes = [data[cut:]], len(data) - cut
            if cut:
                block = data[:cut]
                if first_block:  # a file saved with a UTF-8 byte-order mark: not part of line 1
                    block, first_block = block.removeprefix(UTF8_BOM), False
                lines_done += block.count(b"\n")
                yield block if block.endswith(b"\n") else block + b"\n"  # a last line without its newline
            if not chunk:
                break
        if decompressor is not None and not decompressor.eof:
            raise SourceReadError(
                f"{source}: truncated gzip: the stream ends without its end marker after "
                f"{report.size_bytes:,} compressed bytes (near line {lines_done + 1})"
            )


def _decompress(
    decompressor: zlib._Decompress, chunk: bytes, source: str, report: FileReport, lines_done: int
) -> tuple[bytes, zlib._Decompress]:
    """The chunk's decompressed bytes, and the decompressor for what follows."""
    try:
        out = decompressor.decompress(chunk)
        # Concatenated gzip members (as `cat a.gz b.gz` makes) are one valid stream.
        while decompressor.eof and decompressor.unused_data:
            rest = decompressor.unused_data
            decompressor = zlib.decompressobj(wbits=31)
            out += decompressor.decompress(rest)
        return out, decompressor
    except zlib.error as error:
        raise SourceReadError(
            f"{source}: corrupt gzip data after {report.size_bytes:,} compressed bytes "
            f"(near line {lines_done + 1}): {error}"
        ) from None


class ParquetSink:
    """A Parquet writer that buffers small tables into streaming-sized row groups and
    writes each one in a background thread (one at a time, in order)."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path, self.schema = path, schema
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.writer = pq.ParquetWriter(path, schema, compression="zstd")
        self.background = ThreadPoolExecutor(1, thread_name_prefix="parquet-write")
        self.in_flight: Future | None = None

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self.pending.append(table)
            self.pending_rows += table.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        self._wait()  # at most one table in flight bounds memory; its error surfaces here
        if self.pending:
            table = pa.concat_tables(self.pending)
            self.in_flight = self.background.submit(self.writer.write_table, table, row_group_size=ROW_GROUP_ROWS)
            self.pending, self.pending_rows = [], 0

    def _wait(self) -> None:
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            in_flight.result()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            if exc_type is None:
                self._flush()
            self._wait()
        finally:
            self.background.shutdown()
            self.writer.close()


def write_manifest(data_dir: Path, report: DayReport, extra: dict | None = None) -> None:
    """The day's `_manifest.json`; `extra`: what a source adds (a Parquet source: its layout)."""
    manifest = {
        "day": report.day,
        "schema_version": SCHEMA_VERSION,
        "multi_hot": list(report.multi_hot),
        "rows_read": report.rows_read,
        "rows_written": report.rows_written,
        "rows_quarantined": report.rows_quarantined,
        "files": [asdict(f) for f in report.files],
        "source_fingerprints": [fingerprint(f.source) for f in report.files],
        **(extra or {}),
    }
    (data_dir / "_manifest.json").write_text(json.dumps(manifest, indent=2))


def fingerprint(source: str) -> list:
    """What must be unchanged for an ingested day to count as done: path, size, mtime."""
    try:
        info = os.stat(source)
        return [source, info.st_size, info.st_mtime_ns]
    except OSError:
        return [source, None, None]  # a URL: only a forced re-ingest refreshes it


def _already_ingested(sources: Sequence[str], day: int, warehouse: Path, multi_hot: tuple[str, ...]) -> bool:
    manifest = read_manifest(warehouse, day)
    if manifest is None or manifest.get("schema_version") != SCHEMA_VERSION:
        return False
    if tuple(manifest.get("multi_hot", ())) != multi_hot:
        return False  # the same logs read with another layout
    if any(f.get("error") for f in manifest["files"]):
        return False
    return manifest["source_fingerprints"] == [fingerprint(s) for s in sources]


def publish(staged: Path, target: Path, scratch: Path) -> None:
    """Swap `staged` in as `target` with renames: readers never see a half-written folder.

    The old partition moves into `scratch` (same filesystem), which the caller removes.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.rename(scratch / f"retired-{uuid.uuid4().hex[:8]}")
    staged.rename(target)

