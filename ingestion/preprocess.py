"""Feature preprocessing in DuckDB SQL over the Parquet warehouse.

Dense: missing → 0, negative → 0, then ln(1 + x). Categorical: row 0 of each embedding
table is "missing". Then, by `categorical_mode`:
- hash: a present value v maps to 1 + v mod buckets, where each feature gets
  `min(hash_size - 1, 2 × distinct values seen in the training days)` buckets, so small
  features don't pay for a table of `hash_size` rows;
- vocab: values seen at least `min_count` times on the training days get rows 2, 3, … (the
  most frequent first, at most hash_size - 2); any other value maps to row 1, out of
  vocabulary. Each feature's vocabulary is a Parquet file (value, index) beside the state.

Fitting happens once; its result, the `PreprocessState`, is versioned by a hash of the
preprocessing config and the training days' manifests, and the same state is applied to
train and eval days alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb

from ingestion.config import PreprocessConfig
from ingestion.schema import DENSE_COLUMNS, SPARSE_COLUMNS
from ingestion.warehouse import partition_dir, read_manifest

log = logging.getLogger(__name__)
STATE_VERSION = 2
MISSING_ROW, OOV_ROW = 0, 1


class PreprocessError(RuntimeError):
    """Preprocessing cannot run: a day is missing from the warehouse, or a state is stale."""


@dataclass(frozen=True)
class PreprocessState:
    """Everything needed to turn warehouse rows into model features, and the table sizes."""

    state_id: str
    # hash mode: feature → buckets (table rows = buckets + 1);
    # vocab mode: feature → vocabulary entries (table rows = entries + 2).
    buckets: dict[str, int]
    train_days: tuple[int, ...]
    train_rows: int
    train_click_rate: float
    mode: str = "hash"

    @property
    def table_sizes(self) -> dict[str, int]:
        reserved = 2 if self.mode == "vocab" else 1  # missing (+ out of vocabulary)
        return {name: buckets + reserved for name, buckets in self.buckets.items()}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> PreprocessState:
        data = json.loads(path.read_text())  # states saved before `mode` existed are hash states
        return cls(**{**data, "train_days": tuple(data["train_days"])})


def connect(config: PreprocessConfig, spill_dir: Path) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with bounded memory that spills to `spill_dir`."""
    spill_dir.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{config.duckdb_memory_limit}'")
    con.execute(f"SET threads = {int(config.duckdb_threads)}")
    con.execute(f"SET temp_directory = '{spill_dir}'")
    con.execute("SET preserve_insertion_order = false")
    return con


def _day_glob(warehouse: Path, day: int) -> str:
    folder = partition_dir(warehouse, day)
    if not any(folder.glob("*.parquet")):
        raise PreprocessError(f"day {day}: no Parquet in {folder}; ingest that day first")
    return str(folder / "*.parquet")


def state_id_for(config: PreprocessConfig, warehouse: Path, train_days: Sequence[int]) -> str:
    """Hash of what the fitted state depends on: the config and the training days' manifests."""
    manifests = [read_manifest(warehouse, day) for day in sorted(train_days)]
    parts = {
        "version": STATE_VERSION,
        "hash_size": config.hash_size,
        "mode": config.categorical_mode,
        "min_count": config.min_count if config.categorical_mode == "vocab" else None,
        "days": sorted(train_days),
        "sources": [m and [f["sha256"] for f in m["files"]] for m in manifests],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def fit_state(config: PreprocessConfig, warehouse: Path, features_root: Path, train_days: Sequence[int]) -> PreprocessState:
    """Count distinct values per feature on the training days; reuse a saved state if current."""
    state_id = state_id_for(config, warehouse, train_days)
    state_path = features_root / state_id / "state.json"
    if state_path.is_file():
        log.info("preprocessing state %s is current, reusing it", state_id)
        return PreprocessState.load(state_path)
    globs = [_day_glob(warehouse, day) for day in sorted(train_days)]
    con = connect(config, features_root / "_spill")
    distinct = ", ".join(f"approx_count_distinct({c})" for c in SPARSE_COLUMNS)
    row = con.execute(
        f"SELECT count(*), avg(label), {distinct} FROM read_parquet(?)", [globs]
    ).fetchall()[0]
    rows, click_rate, counts = int(row[0]), float(row[1] or 0.0), row[2:]
    state_path.parent.mkdir(parents=True, exist_ok=True)
    if config.categorical_mode == "vocab":
        buckets = _fit_vocabularies(con, config, globs, state_path.parent / "vocab")
    else:
        buckets = {name: max(1, min(config.hash_size - 1, 2 * int(n))) for name, n in zip(SPARSE_COLUMNS, counts)}
    state = PreprocessState(state_id, buckets, tuple(sorted(train_days)), rows, click_rate, config.categorical_mode)
    state.save(state_path)  # written last: a state without its vocabularies is never seen
    log.info("fitted preprocessing state %s on %s rows of days %s", state_id, f"{rows:,}", list(train_days))
    return state


def _fit_vocabularies(con: duckdb.DuckDBPyConnection, config: PreprocessConfig, globs: list[str],
                      folder: Path) -> dict[str, int]:  # fmt: skip
    """One Parquet (value, index) per feature; returns each vocabulary's size."""
    folder.mkdir(parents=True, exist_ok=True)
    limit = config.hash_size - 2
    sizes = {}
    for column in SPARSE_COLUMNS:
        path = folder / f"{column}.parquet"
        # Most frequent first; ties by value, so the same data always gives the same indices.
        con.execute(
            f"COPY (SELECT {column} AS value, (1 + row_number() OVER (ORDER BY n DESC, {column}))::INTEGER AS index "
            f"FROM (SELECT {column}, count(*) AS n FROM read_parquet(?) WHERE {column} IS NOT NULL "
            f"GROUP BY {column} HAVING count(*) >= {int(config.min_count)}) ORDER BY n DESC, {column} LIMIT {limit}) "
            f"TO '{path}' (FORMAT parquet)",
            [globs],
        )
        sizes[column] = con.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchall()[0][0]
    return sizes


def vocabulary_path(features_root: Path, state: PreprocessState, feature: str) -> Path:
    return features_root / state.state_id / "vocab" / f"{feature}.parquet"


def feature_sql(state: PreprocessState, features_root: Path | None = None) -> str:
    """The SELECT that turns warehouse rows into features (`{source}` is the input)."""
    dense = [f"ln(1 + greatest(coalesce(s.{c}, 0), 0))::FLOAT AS {c}" for c in DENSE_COLUMNS]
    if state.mode != "vocab":
        sparse = [
            f"CASE WHEN s.{c} IS NULL THEN {MISSING_ROW} ELSE 1 + (s.{c} % {state.buckets[c]}) END::INTEGER AS {c}"
            for c in SPARSE_COLUMNS
        ]
        return "SELECT s.label::TINYINT AS label, " + ", ".join(dense + sparse) + " FROM {source} s"
    if features_root is None:
        raise PreprocessError("a vocabulary state needs its features folder to find the vocabularies")
    sparse, joins = [], []
    for i, c in enumerate(SPARSE_COLUMNS):
        sparse.append(f"CASE WHEN s.{c} IS NULL THEN {MISSING_ROW} ELSE coalesce(v{i}.index, {OOV_ROW}) END::INTEGER AS {c}")
        vocab = vocabulary_path(features_root, state, c)
        joins.append(f"LEFT JOIN read_parquet('{vocab}') v{i} ON s.{c} = v{i}.value")
    return ("SELECT s.label::TINYINT AS label, " + ", ".join(dense + sparse)
            + " FROM {source} s " + " ".join(joins))  # fmt: skip


def features_dir(features_root: Path, state: PreprocessState, day: int) -> Path:
    return features_root / state.state_id / f"day={day}"


def apply_state(config: PreprocessConfig, state: PreprocessState, warehouse: Path, features_root: Path, day: int) -> Path:
    """Write one day's features atomically; skipped when they already exist for this state."""
    target = features_dir(features_root, state, day)
    if (target / "_done.json").is_file():
        return target
    staging = features_root / "_tmp" / f"day={day}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        con = connect(config, features_root / "_spill")
        query = feature_sql(state, features_root).format(source=f"read_parquet('{_day_glob(warehouse, day)}')")
        con.execute(
            f"COPY ({query}) TO '{staging / 'part-00000.parquet'}' "
            f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {config.row_group_size})"
        )
        rows = con.execute(f"SELECT count(*) FROM read_parquet('{staging}/*.parquet')").fetchall()[0][0]
        (staging / "_done.json").write_text(json.dumps({"day": day, "rows": rows, "state_id": state.state_id}))
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)  # an interrupted earlier attempt (no _done.json)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("day %d: %s feature rows → %s", day, f"{rows:,}", target)
    return target
