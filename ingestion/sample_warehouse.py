"""A generated hive-partitioned warehouse in a user's own shape, for the example config,
the tests and the benchmarks of the Parquet source.

Rows come from the synthetic Criteo generator (so there is a signal to learn), renamed and
retyped as a product team would store them: a bool label `clicked`, numeric columns, a
string id, integer ids (negative ones too), a list of string tags (multi-hot), nulls, and a
few rows with a bad label. Each day is `ds=YYYY-MM-DD/part-0000K.parquet` plus `_SUCCESS`.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ingestion.config import SyntheticConfig
from ingestion.synthetic import GroundTruth, generate_chunk

DENSE = {"price": "I1", "views": "I2", "dwell_s": "I3", "age_days": "I4", "position": "I5", "clicks_7d": "I6"}
STRING_IDS = {"user_id": "C1", "site": "C4", "device": "C6", "country": "C8", "campaign": "C10"}
INT_IDS = {"item_id": "C2", "ad_id": "C5", "creative_id": "C7", "slot": "C9"}
TAGS = ("tags", "C3")
SPARSE = ("user_id", "item_id", "tags", "site", "ad_id", "device", "creative_id", "country", "slot", "campaign")
BAD_LABEL_EVERY = 1000  # one row in this many has label 2 or null
NAN_PRICE_EVERY = 2000  # one row in this many has a NaN price


def write_sample_warehouse(root: Path, dates: Sequence[str], rows_per_day: int, seed: int = 7,
                           files_per_day: int = 2, cardinality_scale: float = 0.01, signal_drift: float = 0.0,
                           signal_scale: float = 1.0) -> None:  # fmt: skip
    """Write one partition per date (an existing partition is rewritten). The i-th date is
    the generator's day i: with `signal_drift`, its click signal has turned i times."""
    config = SyntheticConfig(rows_per_day=rows_per_day, seed=seed, cardinality_scale=cardinality_scale,
                             multi_hot_mean_ids=3.0, signal_drift=signal_drift, signal_scale=signal_scale)  # fmt: skip
    truth = GroundTruth(config, multi_hot=(TAGS[1],))
    for index, date in enumerate(dates):
        rng = np.random.default_rng([seed, 0x5A, index])
        folder = root / f"ds={date}"
        folder.mkdir(parents=True, exist_ok=True)
        for part, rows in enumerate(np.array_split(np.arange(rows_per_day), files_per_day)):
            raw, _ = generate_chunk(truth, rng, len(rows), index)
            pq.write_table(user_table(raw, rng), folder / f"part-{part:05d}.parquet", row_group_size=16_384)
        (folder / "_SUCCESS").touch()


def user_table(raw: pa.Table, rng: np.random.Generator) -> pa.Table:
    """Criteo-format rows (label, I*, C* as hex text) → the user's columns."""
    rows = raw.num_rows
    label = raw["label"].to_numpy().astype(np.int64)
    bad = rng.random(rows) < 1.0 / BAD_LABEL_EVERY
    label_array = pa.array(np.where(bad & (rng.random(rows) < 0.5), 2, label), pa.int64(),
                           mask=bad & (label >= 0) & (rng.random(rows) < 0.5))  # fmt: skip
    columns: dict[str, pa.Array] = {"clicked": label_array}
    for name, field in DENSE.items():
        columns[name] = pc.cast(raw[field], pa.float64() if name in ("price", "dwell_s") else pa.int32())
    price = columns["price"].to_numpy(zero_copy_only=False)
    price[rng.random(rows) < 1.0 / NAN_PRICE_EVERY] = np.nan
    columns["price"] = pa.array(price, pa.float64(), mask=raw[DENSE["price"]].is_null().to_numpy(zero_copy_only=False))
    for name, field in STRING_IDS.items():
        columns[name] = pc.binary_join_element_wise(f"{name[0]}_", raw[field], "")
    for name, field in INT_IDS.items():
        numbers = pc.cast(pc.fill_null(raw[field], "0"), pa.string()).to_pylist()
        values = np.array([int(text, 16) - 2**31 for text in numbers], dtype=np.int64)
        columns[name] = pa.array(values, pa.int64(), mask=raw[field].is_null().to_numpy(zero_copy_only=False))
    columns[TAGS[0]] = pc.split_pattern(raw[TAGS[1]], ",")
    return pa.table({name: columns[name] for name in ("clicked", *DENSE, *SPARSE)})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m ingestion.sample_warehouse", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the warehouse folder (ds=YYYY-MM-DD partitions go inside)")
    parser.add_argument("--first", default="2026-11-17", help="the first day's date")
    parser.add_argument("--days", type=int, default=5)
    parser.add_argument("--rows-per-day", type=int, default=100_000)
    args = parser.parse_args()
    first = dt.date.fromisoformat(args.first)
    dates = [(first + dt.timedelta(days=i)).isoformat() for i in range(args.days)]
    write_sample_warehouse(args.out, dates, args.rows_per_day)
    print(f"wrote {args.days} days of {args.rows_per_day:,} rows to {args.out} ({dates[0]} … {dates[-1]})")


if __name__ == "__main__":
    main()
