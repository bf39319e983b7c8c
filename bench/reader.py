"""Reader throughput at batch 8192 against a raw `pyarrow.parquet` decode of the same files.

The raw decode (every row group, every column, to Arrow) is the limit a reader can reach;
the reader also turns rows into TorchRec batches (dense tensor, KeyedJaggedTensor, labels).
Also the peak RSS of reading 1× and 10× the rows, each in a fresh process.

Prints its figures last as one JSON line: reader_rows_per_s, raw_decode_rows_per_s,
reader_fraction_of_raw, peak_rss_mb_1x, peak_rss_mb_10x.
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

import pyarrow.parquet as pq

from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import apply_state, fit_state
from ingestion.reader import build_reader
from ingestion.synthetic import GroundTruth, generate_day
from ingestion.warehouse import ingest_day

ROWS, BATCH = 1_000_000, 8192


def feature_files(folder: Path, rows: int, day: int) -> list[str]:
    config = SyntheticConfig(rows_per_day=rows, seed=9)
    generate_day(config, day, folder / "raw", GroundTruth(config))
    ingest_day([str(folder / "raw" / f"day_{day}.tsv.gz")], day, folder / "warehouse")
    preprocess = PreprocessConfig()
    state = fit_state(preprocess, folder / "warehouse", folder / f"features-{day}", (day,))
    out = apply_state(preprocess, state, folder / "warehouse", folder / f"features-{day}", day)
    return [str(p) for p in sorted(out.glob("*.parquet"))]


def raw_decode(files: list[str]) -> float:
    started, rows = time.perf_counter(), 0
    for path in files:
        handle = pq.ParquetFile(path)
        for group in range(handle.num_row_groups):
            rows += handle.read_row_group(group).num_rows
    return rows / (time.perf_counter() - started)


def reader(files: list[str]) -> float:
    started, rows = time.perf_counter(), 0
    for batch in build_reader(files, BATCH, drop_remainder=False):
        rows += len(batch.labels)
    return rows / (time.perf_counter() - started)


def peak_rss_of_reading(files: list[str]) -> float:
    code = (
        "import re, sys, json; sys.path.insert(0, sys.argv[1]);"
        "from ingestion.reader import build_reader;"
        "[None for _ in build_reader(json.loads(sys.argv[2]), 8192, drop_remainder=False)];"
        # VmHWM: this process's own peak; ru_maxrss would carry over the forking parent's
        "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) / 1024)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(ROOT), json.dumps(files)],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return float(result.stdout.strip().splitlines()[-1])


def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = feature_files(folder, ROWS, 0)
        raw = max(raw_decode(files) for _ in range(2))  # warm page cache, best of two
        read = max(reader(files) for _ in range(2))
        rss_1x = peak_rss_of_reading(files)
        rss_10x = peak_rss_of_reading(feature_files(folder, 10 * ROWS, 1))
    print(f"reader {read:,.0f} rows/s vs raw decode {raw:,.0f} rows/s ({read / raw:.0%}); "
          f"peak RSS {rss_1x:,.0f} MB (1x) vs {rss_10x:,.0f} MB (10x)")
    return {
        "reader_rows_per_s": round(read),
        "raw_decode_rows_per_s": round(raw),
        "reader_fraction_of_raw": round(read / raw, 3),
        "peak_rss_mb_1x": round(rss_1x),
        "peak_rss_mb_10x": round(rss_10x),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
