"""A validation slice of the training days: the rows tuning scores trials on.

Tuning and calibration must never look at the evaluation days. So the training days' feature
rows are split, deterministically by a hash of each row's own values, into a fit part (trials
and the run train on it) and a validation part (trials are scored on it, the run's calibrator
is fitted on it: flows/run/rows.py). The same rows land on the same side in every run, on
every machine, whatever the file layout.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from ingestion.staging import new_staging, release

# Rows whose hash falls in the first `percent` of 1,000 buckets are validation rows.
BUCKETS = 1000


@dataclass(frozen=True)
class HoldoutSplit:
    fit_files: tuple[str, ...]
    validation_files: tuple[str, ...]
    fit_rows: int
    validation_rows: int


def split_holdout(train_files: Sequence[str], out_dir: Path, percent: float, row_group_size: int = 131_072,
                  threads: int = 2, fold: int = 0) -> HoldoutSplit:  # fmt: skip
    """Split `train_files` (feature Parquet) into fit and validation parts under `out_dir`,
    `percent` % of the rows to validation; reused when `out_dir` holds a finished split of
    the same files. Fold `f` takes the `f`-th slice of `percent` % of the buckets: folds
    0, 1, … hold disjoint validation rows (k-fold scoring on small data); fold 0 is the
    slice tuning and calibration use by default."""
    if not 0 < percent < 100:
        raise ValueError(f"holdout percent must be in (0, 100), got {percent}")
    cut = round(percent * BUCKETS / 100)
    if fold < 0 or (fold + 1) * cut > BUCKETS:
        raise ValueError(f"holdout fold {fold}: {fold + 1} slices of {percent:g} % do not fit in the rows")
    marker = out_dir / "_done.json"
    wanted = {"files": sorted(map(str, train_files)), "percent": percent, **({"fold": fold} if fold else {})}
    if marker.is_file():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in wanted} == wanted:
            return _split_of(out_dir, done)
    staging = new_staging(out_dir.parent, f"_tmp-{out_dir.name}", sweep="_tmp-")
    try:
        con = duckdb.connect(config={"threads": threads})
        source = "read_parquet([" + ", ".join(f"'{f}'" for f in train_files) + "], hive_partitioning = false)"
        # The hash covers every feature value and the label: a row's side is its own.
        columns = pq.read_schema(train_files[0]).names
        key = "hash(" + ", ".join('"' + name + '"' for name in columns) + f") % {BUCKETS}"
        slice_ = f"{key} BETWEEN {fold * cut} AND {(fold + 1) * cut - 1}"
        rows = {}
        for part, condition in (("fit", f"NOT ({slice_})"), ("validation", slice_)):
            (staging / part).mkdir()
            con.execute(f"COPY (SELECT * FROM {source} WHERE {condition}) TO '{staging / part / 'part-00000.parquet'}' "
                        f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {row_group_size})")  # fmt: skip
            rows[part] = con.execute(f"SELECT count(*) FROM read_parquet('{staging / part}/*.parquet')").fetchall()[0][0]
        done = {**wanted, "rows": rows}
        (staging / "_done.json").write_text(json.dumps(done))
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an unfinished or other split
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        release(staging).rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _split_of(out_dir, done)


def _split_of(out_dir: Path, done: dict) -> HoldoutSplit:
    def files(part: str) -> tuple[str, ...]:
        return tuple(str(p) for p in sorted((out_dir / part).glob("*.parquet")))

    return HoldoutSplit(files("fit"), files("validation"), done["rows"]["fit"], done["rows"]["validation"])
