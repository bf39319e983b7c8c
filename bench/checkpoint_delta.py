"""What a night's checkpoint writes in full mode and in delta mode, measured.

    .venv/bin/python bench/checkpoint_delta.py [--nights 4] [--rows-per-day 100000]
        [--table-rows 1000000] [--tables-sized-by-ids] [--cardinality-scale 1.0] [--keep SCRATCH]
        [--config configs/demo.toml]

A recurring lineage on generated days (the demo's config; 26 tables of `--table-rows` rows
each, `preprocess.table_rows = "hash_size"`, as production hash tables are sized; with
`--tables-sized-by-ids`, each of twice the ids the first days hold, at most `--table-rows`,
hash mode's default): a first model on days 0–1, then one
`dlrm run --as-of N` a night, each continuing the newest version on one new day
(`orchestration.continue_from = "latest"`, so that the lineage does not hang on the gate). The same lineage
runs twice on the same days, with `training.checkpoint_mode = "full"` and `"delta"` (a night's
checkpoint is then a delta on the checkpoint of the version it continues). For each night: the bytes of the night's
final checkpoint on disk (`checkpoint_bytes` of the summary: every rank's files and the
metadata), the rows the delta wrote, and, counted with DuckDB over the night's feature
files, the distinct rows of each table that the night's rows look up (an upper bound on the
rows it trained: the night's held-out rows are counted too). `touched_bytes_per_night` is
those rows with their row-wise optimizer state, plus the dense part (the full checkpoint's
bytes less every table and its optimizer state). Last, the delta lineage's newest kept
checkpoint is loaded through its chain and compared with the full lineage's, bit for bit
(both lineages train the same parameters: training is deterministic). With a managed-ids
config (`--config configs/drifting-ids.toml`, with its own `--rows-per-day`,
`--cardinality-scale` and `--table-rows`) the remappers' buffers are part of the dense state,
and a night's distinct raw ids stand for the rows it touched (an upper bound again).

Prints a line a night; last, one JSON line: per night the figures, and their means
(`full_bytes_per_night`, `delta_bytes_per_night`, `touched_bytes_per_night`, `ratio`),
`restore_bit_exact`, and `served_delta_max_abs_diff`: `dlrm export-delta` from the delta
lineage's second-newest version to its newest, applied to the older one's served model,
against the newer one's, on the newest day's raw rows (`served_delta_bytes` beside it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import mlflow
import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from flows.run.config import load_config
from ingestion.preprocess import PreprocessState
from training.loop.checkpoint_chain import META, read_meta
from training.loop.delta_checkpoint import flat_leaves, whole_state

FLOAT_BYTES = 4
CATEGORICAL = [f"C{i}" for i in range(1, 27)]


def sets(overrides: list[str]) -> list[str]:
    """The overrides as `dlrm` arguments."""
    return [part for override in overrides for part in ("--set", override)]


def dlrm_run(config: Path, overrides: list[str], home: Path, as_of: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config), *sets(overrides),
                           "--as-of", str(as_of), "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(home), "HOME": str(home)}, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm run --as-of {as_of} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def newest_kept(run_dir: Path) -> Path:
    """The lineage's newest kept checkpoint (the last night's)."""
    return max((path for path in (run_dir / "lineage").iterdir() if (path / META).is_file()),
               key=lambda path: (path / META).stat().st_mtime)  # fmt: skip


def delta_rows(checkpoint: Path) -> int:
    """The table rows a delta checkpoint wrote (each rank's; 0 for a full one)."""
    if read_meta(checkpoint)["kind"] != "delta":
        return 0
    return sum(len(piece["rows"]) for rows_file in checkpoint.glob("rows-rank-*.pt")
               for path, pieces in torch.load(rows_file, weights_only=True).items() if path.startswith("model/")
               for piece in pieces)  # fmt: skip


def served_delta(config_file: Path, overrides: list[str], root: Path, newest_day: int) -> dict:
    """`dlrm export-delta` between the lineage's two newest versions, and the largest
    difference between the older served model with the delta applied and the newer one."""
    config = load_config(config_file, overrides)
    name, uri = config.tracking.registered_model, config.tracking_uri
    versions = sorted(int(v.version) for v in MlflowClient(uri, uri).search_model_versions(f"name='{name}'"))
    before, after = str(versions[-2]), str(versions[-1])
    out = root / "served-delta"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "export-delta", "--config", str(config_file), *sets(overrides),
                           "--from-version", before, "--to-version", after, "--out", str(out), "--json"], cwd=ROOT,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"dlrm export-delta failed ({done.returncode}): {done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    mlflow.set_tracking_uri(uri)
    served, target = (mlflow.pyfunc.load_model(f"models:/{name}/{v}") for v in (before, after))
    with gzip.open(config.path(config.data.raw_dir) / f"day_{newest_day}.tsv.gz", "rt") as raw:
        frame = pd.DataFrame({"line": raw.read().splitlines()})
    expected = target.predict(frame)
    served.unwrap_python_model().apply_delta(out)
    print(f"served delta {before} → {after}: {report['rows_changed']:,} rows, {report['bytes'] / 2**20:,.2f} MiB", flush=True)
    return {"served_delta_max_abs_diff": float(np.abs(served.predict(frame) - expected).max()),
            "served_delta_bytes": report["bytes"], "served_delta_rows": report["rows_changed"],
            "served_delta_versions": [before, after], "served_delta_scored_rows": len(frame)}


def same_bits(a: dict, b: dict) -> bool:
    """Every leaf of two nested states equal, floats compared by their bits."""
    left, right = flat_leaves(a), flat_leaves(b)
    if left.keys() != right.keys():
        return False
    for path, value in left.items():
        other = right[path]
        if isinstance(value, torch.Tensor):
            if not isinstance(other, torch.Tensor) or value.dtype != other.dtype or value.shape != other.shape:
                return False
            if not torch.equal(value.contiguous().reshape(-1).view(torch.uint8),
                               other.contiguous().reshape(-1).view(torch.uint8)):  # fmt: skip
                return False
        elif value != other:
            return False
    return True


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
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml",
                        help="the lineage's config (generated days): the demo's, or e.g. configs/drifting-ids.toml")
    parser.add_argument("--nights", type=int, default=4, help="nights after the first model")
    parser.add_argument("--rows-per-day", type=int, default=100_000)
    parser.add_argument("--table-rows", type=int, default=1_000_000,
                        help="preprocess.hash_size: the most rows a table has (hash mode sizes each at twice its ids)")
    parser.add_argument("--tables-sized-by-ids", action="store_true",
                        help="size each table at twice the ids the first days hold (hash mode's default), not --table-rows")
    parser.add_argument("--cardinality-scale", type=float, default=1.0,
                        help="data.synthetic.cardinality_scale: 1.0 gives the generated features Criteo's id counts")
    parser.add_argument("--keep", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    started, nights = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="checkpoint-delta-") as temporary:
        root = Path(args.keep or temporary)
        root.mkdir(parents=True, exist_ok=True)
        # the demo's generator, at Criteo's id counts by default (hash mode gives each table twice
        # the ids the first days hold, at most --table-rows); one checkpoint kept beside the lineage's
        common = [f"data.synthetic.rows_per_day={args.rows_per_day}",
                  f"data.synthetic.cardinality_scale={args.cardinality_scale}",
                  f"preprocess.hash_size={args.table_rows}", "training.keep_checkpoints=1", 'tuning.policy="off"',
                  f'preprocess.table_rows="{"ids_seen" if args.tables_sized_by_ids else "hash_size"}"',
                  # each night continues the newest version, promoted or not: a lineage whatever the gate says
                  'orchestration.continue_from="latest"']  # fmt: skip
        modes = {mode: [f'run_dir="{root / mode}"', f'training.checkpoint_mode="{mode}"', *common]
                 for mode in ("full", "delta")}  # fmt: skip
        dim = load_config(args.config, modes["full"]).model.embedding_dim
        for mode, overrides in modes.items():
            first = dlrm_run(args.config, overrides, root / f"home-{mode}", 2)
            print(f"{mode}: first model (days 0–1): {first['checkpoint_bytes']:,} bytes", flush=True)
        for as_of in range(3, 3 + args.nights):
            summaries = {mode: dlrm_run(args.config, overrides, root / f"home-{mode}", as_of)
                         for mode, overrides in modes.items()}  # fmt: skip
            full, delta = summaries["full"]["checkpoint_bytes"], summaries["delta"]["checkpoint_bytes"]
            features, rows = root / "full" / "features", table_rows(root / "full" / "features")
            dense = full - rows * (dim + 1) * FLOAT_BYTES  # the MLPs, Adam's moments, the metadata
            touched = touched_rows(features, summaries["full"]["days_trained"])
            kept = newest_kept(root / "delta")
            nights.append({"as_of": as_of, "days_trained": summaries["full"]["days_trained"],
                           "rows_trained": summaries["full"]["rows_trained"], "full_bytes": full, "delta_bytes": delta,
                           "delta_kind": read_meta(kept)["kind"], "delta_rows": delta_rows(kept), "table_rows": rows,
                           "touched_rows": touched, "touched_share": touched / rows,
                           "touched_bytes": dense + touched * (dim + 1) * FLOAT_BYTES, "ratio": full / delta,
                           "eval_ne": {mode: summary["eval_ne"] for mode, summary in summaries.items()}})  # fmt: skip
            night = nights[-1]
            print(f"night {as_of}: {night['rows_trained']:,} rows trained; full checkpoint {full / 2**20:,.1f} MiB, "
                  f"{night['delta_kind']} {delta / 2**20:,.1f} MiB ({night['ratio']:.2f}× less; {night['delta_rows']:,} "
                  f"rows written); {touched:,} of {rows:,} table rows touched ({100 * night['touched_share']:.2f} %), "
                  f"{night['touched_bytes'] / 2**20:,.1f} MiB with the dense part", flush=True)  # fmt: skip
        load_started = time.perf_counter()
        restored = whole_state(newest_kept(root / "delta"), root)
        load_s = time.perf_counter() - load_started
        bit_exact = same_bits(restored, whole_state(newest_kept(root / "full"), root))
        served = served_delta(args.config, modes["delta"], root, 2 + args.nights)
    mean = lambda key: statistics.fmean(n[key] for n in nights)
    print(json.dumps({"nights": nights, "full_bytes_per_night": mean("full_bytes"),
                      "delta_bytes_per_night": mean("delta_bytes"), "touched_bytes_per_night": mean("touched_bytes"),
                      "ratio": mean("full_bytes") / mean("delta_bytes"),
                      "delta_over_touched": mean("delta_bytes") / mean("touched_bytes"),
                      "mean_touched_share": mean("touched_share"), "restore_bit_exact": bit_exact,
                      "chain_load_s": round(load_s, 2), **served,
                      "rows_per_day": args.rows_per_day, "table_rows": args.table_rows,
                      "tables_sized_by_ids": args.tables_sized_by_ids, "config": str(args.config),
                      "seconds": round(time.perf_counter() - started, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
