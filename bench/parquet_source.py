"""Reading a user's own Parquet warehouse (`data.source = "parquet"`) against reading this
pipeline's own warehouse, and the memory of ingesting 1 day against several.

In one run, on a generated hive warehouse (`ingestion/sample_warehouse.py`: 6 dense
columns, 10 id columns of which 5 text and 1 a list, nulls, bad labels), per day:
(1) `ingest_parquet_day`: stream the partition's files, validate, hash text ids, quarantine,
write the warehouse day; (2) the baseline: a plain Arrow stream of the same day out of this
pipeline's own warehouse (what every later stage reads), no validation; (3) a plain Arrow
stream of the source's files, for the cost of reading them at all; (4) DuckDB feature
preprocessing of the ingested day. Also the peak RSS of a fresh process ingesting 1 day and
all of them: memory must stay flat as days grow.

Prints its figures last as one JSON line: source_ingest_rows_per_s,
own_warehouse_read_rows_per_s, source_plain_read_rows_per_s, ingest_vs_own_warehouse_read,
preprocess_rows_per_s, peak_rss_mb_1_day, peak_rss_mb_all_days, days, rows_per_day.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq

from ingestion.config import DataConfig, PreprocessConfig
from ingestion.days import parse_day
from ingestion.parquet_source import ingest_parquet_day
from ingestion.preprocess import apply_state, fit_state
from ingestion.sample_warehouse import DENSE, SPARSE, write_sample_warehouse
from ingestion.warehouse import partition_dir
from training.codec import decode

DAYS = 4
ROWS_PER_DAY = 250_000
DATES = [(dt.date(2026, 11, 17) + dt.timedelta(days=i)).isoformat() for i in range(DAYS)]


def source_config(source: Path) -> DataConfig:
    return decode(DataConfig, {"source": "parquet", "path": str(source), "label": "clicked", "dense": list(DENSE),
                               "sparse": list(SPARSE), "train_days": DATES[:-1], "eval_days": DATES[-1:]})  # fmt: skip


def stream_rows(files: list[Path], columns: list[str] | None = None) -> tuple[int, float]:
    """(rows, seconds) of a plain Arrow record-batch stream over `files`."""
    started, rows = time.perf_counter(), 0
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=65_536, columns=columns):
            rows += batch.num_rows
    return rows, time.perf_counter() - started


def peak_rss_of_ingest(source: Path, warehouse: Path, days: int) -> float:
    """Peak RSS (MB) of a fresh process that ingests the first `days` days."""
    code = (
        "import re, sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path;"
        "from bench.parquet_source import DATES, source_config; from ingestion.days import parse_day;"
        "from ingestion.parquet_source import ingest_parquet_day;"
        "source, warehouse = Path(sys.argv[2]), Path(sys.argv[3]);"
        "[ingest_parquet_day(sorted(map(str, (source / f'ds={d}').glob('*.parquet'))), parse_day(d), warehouse,"
        " source_config(source), force=True) for d in DATES[: int(sys.argv[4])]];"
        # VmHWM: this process's own peak; ru_maxrss would carry over the forking parent's
        "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) / 1024)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(ROOT), str(source), str(warehouse), str(days)],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return float(result.stdout.strip().splitlines()[-1])


def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source, warehouse = folder / "source", folder / "warehouse"
        write_sample_warehouse(source, DATES, ROWS_PER_DAY)
        config = source_config(source)
        columns = [config.label, *config.dense, *config.sparse]
        ingest_s = own_read_s = source_read_s = 0.0
        rows_read = rows_written = 0
        for date in DATES:
            files = sorted((source / f"ds={date}").glob("*.parquet"))
            started = time.perf_counter()
            report = ingest_parquet_day([str(f) for f in files], parse_day(date), warehouse, config, force=True)
            ingest_s += time.perf_counter() - started
            rows_read, rows_written = rows_read + report.rows_read, rows_written + report.rows_written
            own_rows, seconds = stream_rows(sorted(partition_dir(warehouse, parse_day(date)).glob("*.parquet")))
            assert own_rows == report.rows_written
            own_read_s += seconds
            source_read_s += stream_rows(files, columns)[1]
        preprocess = PreprocessConfig(hash_size=100_000)
        state = fit_state(preprocess, warehouse, folder / "features", config.train_days)
        started = time.perf_counter()
        apply_state(preprocess, state, warehouse, folder / "features", config.eval_days[0])
        preprocess_s = time.perf_counter() - started
        rss_1 = peak_rss_of_ingest(source, folder / "rss-1", 1)
        rss_all = peak_rss_of_ingest(source, folder / "rss-all", DAYS)
    ingest, own, plain = rows_read / ingest_s, rows_written / own_read_s, rows_read / source_read_s
    print(f"{DAYS} days × {ROWS_PER_DAY:,} rows: ingest from the Parquet source {ingest:,.0f} rows/s; plain Arrow "
          f"stream of this pipeline's warehouse {own:,.0f} rows/s and of the source {plain:,.0f} rows/s; "
          f"preprocess {ROWS_PER_DAY / preprocess_s:,.0f} rows/s; peak RSS {rss_1:,.0f} MB (1 day) vs "
          f"{rss_all:,.0f} MB ({DAYS} days)")  # fmt: skip
    return {
        "source_ingest_rows_per_s": round(ingest),
        "own_warehouse_read_rows_per_s": round(own),
        "source_plain_read_rows_per_s": round(plain),
        "ingest_vs_own_warehouse_read": round(ingest / own, 3),
        "preprocess_rows_per_s": round(ROWS_PER_DAY / preprocess_s),
        "peak_rss_mb_1_day": round(rss_1),
        "peak_rss_mb_all_days": round(rss_all),
        "days": DAYS,
        "rows_per_day": ROWS_PER_DAY,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
