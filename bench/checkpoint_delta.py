"""What a night's full checkpoint writes, and what a checkpoint of only the rows it touched would.

    .venv/bin/python bench/checkpoint_delta.py [--nights 4] [--rows-per-day 100000]
        [--table-rows 1000000] [--cardinality-scale 1.0] [--keep SCRATCH]

A recurring lineage on generated days (the demo's config; 26 tables, each of twice the ids
the first days hold, at most `--table-rows`): a first model on days 0–1, then one
`dlrm run --as-of N` a night, each continuing the champion on one new day. For each night it
reads the bytes of the served model's final checkpoint on disk (`checkpoint_bytes` of the
summary: every table, its row-wise optimizer state, the MLPs and Adam's moments) and counts,
with DuckDB over the night's feature files, the distinct rows of each table that the night's
rows look up. From those it projects the bytes of a differential checkpoint (the dense part
and its optimizer state as they are, plus each touched row's floats, its optimizer state and
its index): the Check-N-Run ratio, full ÷ delta. The projection is an upper bound on the
delta's size (the night's held-out rows are counted as touched) and a projection, not a
measurement: a delta mode is not built yet.

Prints a table; last, one JSON line: per night the bytes written, the touched share, the
projected delta bytes and the ratio, and their means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flows.run.config import load_config
from ingestion.preprocess import PreprocessState

FLOAT_BYTES, INDEX_BYTES = 4, 8
CATEGORICAL = [f"C{i}" for i in range(1, 27)]


def dlrm_run(overrides: list[str], home: Path, as_of: int) -> dict:
    arguments = [part for override in overrides for part in ("--set", override)]
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", "configs/demo.toml", *arguments,
                           "--as-of", str(as_of), "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm run --as-of {as_of} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def touched_rows(features: Path, days: list[int]) -> int:
    """Distinct rows of every table that the days' feature rows look up (row ids per table)."""
    files = [str(path) for day in days for path in sorted(features.glob(f"*/day={day}/*.parquet"))]
    counts = ", ".join(f"count(DISTINCT {column})" for column in CATEGORICAL)
    found = duckdb.connect().execute(f"SELECT {counts} FROM read_parquet({files!r})").fetchone()
    return int(sum(found or ()))


def table_rows(features: Path) -> int:
    """Rows of every table together, as the fitted preprocessing state sizes them."""
    return sum(PreprocessState.load(next(features.glob("*/state.json"))).table_sizes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nights", type=int, default=4, help="nights after the first model")
    parser.add_argument("--rows-per-day", type=int, default=100_000)
    parser.add_argument("--table-rows", type=int, default=1_000_000,
                        help="preprocess.hash_size: the most rows a table has (hash mode sizes each at twice its ids)")
    parser.add_argument("--cardinality-scale", type=float, default=1.0,
                        help="data.synthetic.cardinality_scale: 1.0 gives the generated features Criteo's id counts")
    parser.add_argument("--keep", type=Path, help="keep the run folder here (default: a temporary folder)")
    args = parser.parse_args()
    started, nights = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="checkpoint-delta-") as temporary:
        root = Path(args.keep or temporary)
        root.mkdir(parents=True, exist_ok=True)
        # the demo's generator, at Criteo's id counts by default (hash mode gives each table twice
        # the ids the first days hold, at most --table-rows); one checkpoint kept beside the lineage's
        overrides = [f'run_dir="{root / "run"}"', f"data.synthetic.rows_per_day={args.rows_per_day}",
                     f"data.synthetic.cardinality_scale={args.cardinality_scale}",
                     f"preprocess.hash_size={args.table_rows}", "training.keep_checkpoints=1",
                     'tuning.policy="off"']  # fmt: skip
        features = root / "run" / "features"
        dim = load_config(ROOT / "configs" / "demo.toml", overrides).model.embedding_dim
        first = dlrm_run(overrides, root / "home", 2)
        print(f"first model (days 0–1): {first['checkpoint_bytes']:,} bytes", flush=True)
        for as_of in range(3, 3 + args.nights):
            summary = dlrm_run(overrides, root / "home", as_of)
            full, rows = summary["checkpoint_bytes"], table_rows(features)
            embedding = rows * (dim + 1) * FLOAT_BYTES  # each row's floats and its row-wise Adagrad state
            touched = touched_rows(features, summary["days_trained"])
            delta = (full - embedding) + touched * ((dim + 1) * FLOAT_BYTES + INDEX_BYTES)
            nights.append({"as_of": as_of, "days_trained": summary["days_trained"], "rows_trained": summary["rows_trained"],
                           "full_bytes": full, "table_rows": rows, "touched_rows": touched, "touched_share": touched / rows,
                           "projected_delta_bytes": delta, "ratio": full / delta, "eval_ne": summary["eval_ne"]})  # fmt: skip
            night = nights[-1]
            print(f"night {as_of}: {night['rows_trained']:,} rows trained; full checkpoint {full / 2**20:,.0f} MiB; "
                  f"touched {touched:,} of {rows:,} table rows ({100 * night['touched_share']:.2f} %); a delta would "
                  f"write {delta / 2**20:,.1f} MiB: {night['ratio']:.1f}× less", flush=True)  # fmt: skip
    print(json.dumps({"nights": nights, "mean_touched_share": statistics.fmean(n["touched_share"] for n in nights),
                      "mean_ratio": statistics.fmean(n["ratio"] for n in nights), "projected": True,
                      "rows_per_day": args.rows_per_day, "table_rows": args.table_rows,
                      "seconds": round(time.perf_counter() - started, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
