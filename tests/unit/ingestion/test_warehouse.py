import gzip
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ingestion import warehouse
from ingestion.schema import WAREHOUSE_SCHEMA
from ingestion.warehouse import day_of, ingest_day, partition_dir, read_manifest

GOOD = "0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + "\t".join(["deadbeef"] * 26)



def warehouse_rows(warehouse: Path, day: int) -> int:
    """Rows in a published partition, from Parquet footers (no data is read)."""
    files = sorted(partition_dir(warehouse, day).glob("*.parquet"))
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)

def _write(path: Path, lines: list[str], gzipped: bool = True) -> str:
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if gzipped else data)
    return str(path)


def test_day_comes_from_the_name_or_the_position() -> None:
    assert day_of("/data/day_23.gz", 0) == 23
    assert day_of("s3://bucket/criteo/day_4.tsv.gz", 0) == 4
    assert day_of("/kaggle/train.txt", 2) == 2


def test_rows_in_equal_rows_written_plus_quarantined(tmp_path: Path) -> None:
    source = _write(tmp_path / "day_3.gz", [GOOD] * 10 + ["bad line"] * 3 + [GOOD] * 5)
    report = ingest_day([source], 3, tmp_path / "wh")
    assert (report.rows_read, report.rows_written, report.rows_quarantined) == (18, 15, 3)
    assert warehouse_rows(tmp_path / "wh", 3) == 15
    quarantine = pq.read_table(tmp_path / "wh" / "_quarantine" / "day=3")
    assert quarantine.num_rows == 3
    assert quarantine["line"].to_pylist() == [11, 12, 13]
    manifest = read_manifest(tmp_path / "wh", 3)
    assert manifest["rows_read"] == manifest["rows_written"] + manifest["rows_quarantined"] == 18
    assert len(manifest["files"][0]["sha256"]) == 64


@pytest.mark.parametrize("gzipped", [True, False])
def test_a_byte_order_mark_before_line_1_is_not_part_of_it(tmp_path: Path, gzipped: bool) -> None:
    data = ("\ufeff" + "".join(line + "\n" for line in [GOOD] * 3)).encode()
    source = tmp_path / ("day_0.gz" if gzipped else "day_0.tsv")
    source.write_bytes(gzip.compress(data) if gzipped else data)
    report = ingest_day([str(source)], 0, tmp_path / "wh")
    assert (report.rows_read, report.rows_written, report.rows_quarantined) == (3, 3, 0)
    bom_inside = tmp_path / "day_1.tsv"
    bom_inside.write_bytes((GOOD + "\n\ufeff" + GOOD + "\n").encode())
    assert ingest_day([str(bom_inside)], 1, tmp_path / "wh").rows_quarantined == 1, "only a leading one is dropped"


def test_warehouse_schema_is_typed(tiny_warehouse: Path) -> None:
    table = pq.read_table(tiny_warehouse / "day=0")
    assert [(f.name, f.type) for f in table.schema] == [(f.name, f.type) for f in WAREHOUSE_SCHEMA]
    assert table.num_rows == 6000


def test_plain_and_gzip_files_mix_in_one_day(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.tsv", [GOOD] * 4, gzipped=False)
    b = _write(tmp_path / "b.tsv.gz", [GOOD] * 6)
    report = ingest_day([a, b], 0, tmp_path / "wh")
    assert report.rows_written == 10 and warehouse_rows(tmp_path / "wh", 0) == 10


def test_reingest_replaces_the_partition_without_duplicates(tmp_path: Path) -> None:
    source = tmp_path / "day_0.gz"
    _write(source, [GOOD] * 7)
    ingest_day([str(source)], 0, tmp_path / "wh")
    again = ingest_day([str(source)], 0, tmp_path / "wh")
    assert again.skipped, "same file, same manifest: nothing to do"
    assert warehouse_rows(tmp_path / "wh", 0) == 7
    _write(source, [GOOD] * 4)
    changed = ingest_day([str(source)], 0, tmp_path / "wh")
    assert not changed.skipped
    assert warehouse_rows(tmp_path / "wh", 0) == 4
    forced = ingest_day([str(source)], 0, tmp_path / "wh", force=True)
    assert not forced.skipped and warehouse_rows(tmp_path / "wh", 0) == 4
    assert not (tmp_path / "wh" / "_tmp").exists(), "no staging folders are left behind"


def test_truncated_gzip_fails_that_file_only(tmp_path: Path) -> None:
    good = _write(tmp_path / "day_1.gz", [GOOD] * 2000)
    whole = gzip.compress(("".join(GOOD + "\n" for _ in range(5000))).encode())
    truncated = tmp_path / "day_1b.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    report = ingest_day([good, str(truncated)], 1, tmp_path / "wh")
    assert len(report.files_failed) == 1
    error = report.files_failed[0].error
    assert str(truncated) in error and "truncated gzip" in error and "near line" in error
    assert report.rows_written == 2000
    assert warehouse_rows(tmp_path / "wh", 1) == 2000, "the readable file was still ingested"
    files = read_manifest(tmp_path / "wh", 1)["files"]
    assert sum(f["rows_written"] for f in files) == 2000, "the failed file's parsed rows were not published"
    assert all(f["rows_read"] == f["rows_written"] + f["rows_quarantined"] for f in files)
    assert not (tmp_path / "wh" / "_tmp").exists(), "no staging folder left behind"


def test_an_empty_source_is_warned_about(tmp_path: Path, caplog) -> None:
    empty = tmp_path / "day_0.gz"
    empty.write_bytes(gzip.compress(b""))
    with caplog.at_level("WARNING", logger=warehouse.log.name):
        report = ingest_day([str(empty)], 0, tmp_path / "wh")
    assert report.rows_read == 0
    assert any("no lines in" in r.getMessage() and "empty partition" in r.getMessage() for r in caplog.records)


def test_unreadable_only_file_leaves_the_old_partition(tmp_path: Path) -> None:
    source = _write(tmp_path / "day_2.gz", [GOOD] * 3)
    ingest_day([source], 2, tmp_path / "wh")
    report = ingest_day([str(tmp_path / "missing.gz")], 2, tmp_path / "wh")
    assert "cannot open" in report.files_failed[0].error
    assert warehouse_rows(tmp_path / "wh", 2) == 3


def test_interrupted_ingest_never_shows_a_half_partition(tmp_path: Path, monkeypatch) -> None:
    source = _write(tmp_path / "day_5.gz", [GOOD] * 9)
    ingest_day([source], 5, tmp_path / "wh")
    from ingestion import warehouse

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(warehouse, "write_manifest", crash)
    _write(tmp_path / "day_5.gz", [GOOD] * 2)
    with pytest.raises(KeyboardInterrupt):
        ingest_day([source], 5, tmp_path / "wh")
    assert warehouse_rows(tmp_path / "wh", 5) == 9, "the old partition is intact"
    assert read_manifest(tmp_path / "wh", 5)["rows_written"] == 9
    shutil.rmtree(tmp_path / "wh")


def test_concatenated_gzip_members_read_as_one_file(tmp_path: Path, monkeypatch) -> None:
    """`cat a.gz b.gz c.gz` is one valid gzip stream; reads small enough that member
    boundaries fall inside and between chunks."""
    monkeypatch.setattr(warehouse, "READ_CHUNK_BYTES", 512)
    members = [gzip.compress("".join(GOOD + "\n" for _ in range(n)).encode()) for n in (300, 1, 450)]
    source = tmp_path / "day_2.gz"
    source.write_bytes(b"".join(members))
    report = ingest_day([str(source)], 2, tmp_path / "wh")
    assert report.rows_read == report.rows_written == 751 and not report.files_failed


def test_line_numbers_stay_exact_across_many_small_blocks(tmp_path: Path, monkeypatch) -> None:
    """Blocks are parsed while the next are read in a thread: quarantined line numbers and
    the reconciliation must not depend on where the blocks were cut."""
    monkeypatch.setattr(warehouse, "READ_CHUNK_BYTES", 1000)
    monkeypatch.setattr(warehouse, "PARSE_BLOCK_BYTES", 3000)
    lines = [GOOD if i % 37 else "1\t2" for i in range(1, 2001)]
    source = _write(tmp_path / "day_3.gz", lines)
    report = ingest_day([source], 3, tmp_path / "wh")
    bad = pq.read_table(tmp_path / "wh" / "_quarantine" / "day=3")["line"].to_pylist()
    assert sorted(bad) == [i for i in range(1, 2001) if i % 37 == 0]
    assert report.rows_written == 2000 - len(bad) and warehouse_rows(tmp_path / "wh", 3) == report.rows_written
