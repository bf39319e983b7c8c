"""Ingest and preprocessing speed against DuckDB's plain `COPY … TO parquet` of the same file.

In one run, on one generated day: (1) DuckDB converting the TSV.gz to Parquet with no
validation (the baseline), (2) `ingest_day` (parse, validate every field, quarantine, typed
Parquet), (3) DuckDB feature preprocessing of the ingested day. Also the peak RSS of
ingesting 1× and 10× the rows, each in a fresh process: memory must stay flat.

Prints its figures last as one JSON line: ingest_rows_per_s, preprocess_rows_per_s,
baseline_copy_rows_per_s, validation_cost_fraction, peak_rss_mb_1x, peak_rss_mb_10x.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import duckdb

from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.schema import RAW_COLUMNS
from ingestion.synthetic import GroundTruth, generate_day
from ingestion.warehouse import ingest_day

ROWS = 1_000_000


def baseline_copy(source: Path, target: Path) -> float:
    columns = ", ".join(f"'{name}': 'VARCHAR'" for name in RAW_COLUMNS)
    started = time.perf_counter()
    duckdb.connect().execute(
        f"COPY (SELECT * FROM read_csv('{source}', delim='\\t', header=false, quote='', columns={{{columns}}})) "
        f"TO '{target}' (FORMAT parquet, COMPRESSION zstd)"
    )
    return time.perf_counter() - started


def peak_rss_of_ingest(source: Path, warehouse: Path) -> float:
    """Peak RSS (MB) of a fresh process that ingests `source`."""
    code = (
        "import re, sys; sys.path.insert(0, sys.argv[3]);"
        "from ingestion.warehouse import ingest_day; from pathlib import Path;"
        "ingest_day([sys.argv[1]], 0, Path(sys.argv[2]), force=True);"
        # VmHWM: this process's own peak; ru_maxrss would carry over the forking parent's
        "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) / 1024)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(source), str(warehouse), str(ROOT)],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return float(result.stdout.strip().splitlines()[-1])


def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = SyntheticConfig(rows_per_day=ROWS, seed=5)
        truth = GroundTruth(config)
        generate_day(config, 0, folder / "raw", truth)
        source = folder / "raw" / "day_0.tsv.gz"
        copy_seconds = baseline_copy(source, folder / "copy.parquet")
        started = time.perf_counter()
        report = ingest_day([str(source)], 0, folder / "warehouse")
        ingest_seconds = time.perf_counter() - started
        preprocess = PreprocessConfig()
        state = fit_state(preprocess, folder / "warehouse", folder / "features", (0,))
        started = time.perf_counter()
        apply_state(preprocess, state, folder / "warehouse", folder / "features", 0)
        preprocess_seconds = time.perf_counter() - started
        rss_1x = peak_rss_of_ingest(source, folder / "rss-1x")
        big = SyntheticConfig(rows_per_day=10 * ROWS, seed=5)
        generate_day(big, 1, folder / "raw", GroundTruth(big))
        rss_10x = peak_rss_of_ingest(folder / "raw" / "day_1.tsv.gz", folder / "rss-10x")
    assert report.rows_written == ROWS
    ingest, copy = ROWS / ingest_seconds, ROWS / copy_seconds
    print(f"DuckDB COPY (no validation): {copy:,.0f} rows/s; ingest with validation: {ingest:,.0f} rows/s; "
          f"preprocess: {ROWS / preprocess_seconds:,.0f} rows/s; peak RSS {rss_1x:,.0f} MB (1x) vs {rss_10x:,.0f} MB (10x)")
    return {
        "ingest_rows_per_s": round(ingest),
        "preprocess_rows_per_s": round(ROWS / preprocess_seconds),
        "baseline_copy_rows_per_s": round(copy),
        "validation_cost_fraction": round(1 - ingest / copy, 3),
        "peak_rss_mb_1x": round(rss_1x),
        "peak_rss_mb_10x": round(rss_10x),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
