"""Feature preprocessing in DuckDB SQL over the Parquet warehouse.

Dense: missing → 0, negative → 0, then ln(1 + x). Categorical: row 0 of each embedding
table is "missing". Then, by `categorical_mode`:
- hash: a present value v maps to 1 + v mod buckets, where each feature gets
  `min(hash_size - 1, 2 × distinct values seen in the training days)` buckets, so small
  features don't pay for a table of `hash_size` rows, or for a feature of few values the
  fewest buckets from there that keep its values apart (ingestion/bucket_count.py;
  `table_rows = "hash_size"`: every feature `hash_size - 1`);
- vocab: values seen at least `min_count` times on the training days get rows 2, 3, … (the
  most frequent first, at most hash_size - 2); any other value maps to row 1, out of
  vocabulary. Each feature's vocabulary is a Parquet file (value, index) beside the state;
- managed: the raw id itself (BIGINT; a missing value is the id −2^63): the model's
  managed-collision modules give ids rows as they come and go (training/model/managed_ids.py),
  tables sized as in hash mode (rows = min(hash_size, 2 × distinct values + 1)).

The features are the warehouse's (its days' manifests say which columns are dense and which
categorical: the Criteo layout, or a Parquet source's own columns, ingestion/schema.py).
Integer ids that may be negative (a Parquet source's) hash as 1 + (v mod buckets) with a
non-negative remainder. Multi-hot features (list columns in the warehouse) map every id of a
bag the same way; an empty bag becomes [0], missing. The state records their mean ids per
example, which the sharding planner takes as the tables' pooling factors.

Fitting happens once; its result, the `PreprocessState`, is versioned by a hash of the
preprocessing config and the training days' manifests, and the same state is applied to
train and eval days alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq

from ingestion.bucket_count import SEARCHED_IDS, bucket_count
from ingestion.config import FEW_ROWS, PreprocessConfig
from ingestion.count_bins import CountBins, count_bins_from
from ingestion.cross_ids import Cross, crosses_from
from ingestion.schema import DENSE_COLUMNS, FeatureLayout, multi_hot_of
from ingestion.staging import new_staging, release
from ingestion.warehouse import partition_dir, read_manifest

log = logging.getLogger(__name__)
STATE_VERSION = 3  # 3: multi-hot features
MISSING_ROW, OOV_ROW = 0, 1
# Managed mode: a missing value is this raw id (an id like any other, admitted when frequent).
MISSING_ID = -(2**63)


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
    # multi-hot feature → mean ids per example on the training days (an empty bag counts 1)
    multi_hot: dict[str, float] = field(default_factory=dict)
    # vocab mode: each table's rows, free ones included (`preprocess.vocab_headroom`); empty
    # for states fitted before headroom existed (then entries + 2)
    table_rows: dict[str, int] = field(default_factory=dict)
    # the state this one extends with later days' ids (recurring runs), "" for a fitted one
    parent: str = ""
    # the dense features, in order (the categorical ones are `buckets`' keys, in order), and
    # how each categorical feature's ids were given (empty: the Criteo layout)
    dense: tuple[str, ...] = DENSE_COLUMNS
    id_types: dict[str, str] = field(default_factory=dict)
    # Pairs of features the model crosses (ingestion/cross_ids.py), chosen after the features
    # are written (`model.crosses`, flows/run/crosses.py) and kept by every run that continues
    # the model; not part of `state_id`: the feature files do not hold them.
    crosses: tuple[Cross, ...] = ()
    # Dense features also cut into bins (ingestion/count_bins.py), chosen and kept alike
    # (`model.count_bins`); their tables follow the crosses'.
    count_bins: tuple[CountBins, ...] = ()

    @property
    def table_sizes(self) -> dict[str, int]:
        """The features' own tables (what the feature files' ids index)."""
        if self.table_rows:
            return dict(self.table_rows)
        reserved = 2 if self.mode == "vocab" else 1  # missing (+ out of vocabulary)
        return {name: buckets + reserved for name, buckets in self.buckets.items()}

    @property
    def model_table_sizes(self) -> dict[str, int]:
        """The model's tables: the features' own, then one per cross, then one per count cut into bins."""
        return {**self.table_sizes, **{cross.name: cross.rows for cross in self.crosses},
                **{bins.name: bins.rows for bins in self.count_bins}}  # fmt: skip

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> PreprocessState:
        data = json.loads(path.read_text())  # states saved before `mode` existed are hash states
        return cls(**{**data, "train_days": tuple(data["train_days"]), "dense": tuple(data.get("dense", DENSE_COLUMNS)),
                      "crosses": crosses_from(data.get("crosses", ())),
                      "count_bins": count_bins_from(data.get("count_bins", ()))})  # fmt: skip


def connect(config: PreprocessConfig, spill_dir: Path, keep_order: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with bounded memory that spills to `spill_dir`. `keep_order`: rows
    come out in the order they were read (for the feature files: the trainer's batches are
    cut from them, so another order on a busier machine would train other parameters)."""
    spill_dir.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{config.duckdb_memory_limit}'")
    con.execute(f"SET threads = {int(config.duckdb_threads)}")
    con.execute(f"SET temp_directory = '{spill_dir}'")
    con.execute(f"SET preserve_insertion_order = {str(keep_order).lower()}")
    return con


def _day_glob(warehouse: Path, day: int) -> str:
    folder = partition_dir(warehouse, day)
    if not any(folder.glob("*.parquet")):
        raise PreprocessError(f"day {day}: no Parquet in {folder}; ingest that day first")
    return str(folder / "*.parquet")


def warehouse_layout(warehouse: Path, days: Sequence[int]) -> FeatureLayout:
    """The features of the days' partitions (they must agree): a manifest's layout, or the
    Criteo layout with the multi-hot features its schema shows."""
    layouts = {day: _day_layout(warehouse, day) for day in days}
    if len(set(map(_described, layouts.values()))) > 1:
        described = "; ".join(f"day {day}: {_described(layout)}" for day, layout in layouts.items())
        raise PreprocessError(f"days were ingested with different features ({described}); "
                              "re-ingest them with the same data settings")  # fmt: skip
    return next(iter(layouts.values()))


def _day_layout(warehouse: Path, day: int) -> FeatureLayout:
    manifest = read_manifest(warehouse, day) or {}
    if "layout" in manifest:
        return FeatureLayout.from_dict(manifest["layout"])
    return FeatureLayout.criteo(multi_hot_of(pq.read_schema(_first_file(warehouse, day))))


def _described(layout: FeatureLayout) -> str:
    if layout.is_criteo:
        return f"Criteo, multi-hot {list(layout.multi_hot) or 'none'}"
    return json.dumps(layout.as_dict(), sort_keys=True)


def quoted(column: str) -> str:
    """A column name in SQL: a warehouse's own names may be keywords (`order`, `group`)."""
    return '"' + column.replace('"', '""') + '"'


def _first_file(warehouse: Path, day: int) -> Path:
    _day_glob(warehouse, day)  # a clear error when the day is missing
    return min(partition_dir(warehouse, day).glob("*.parquet"))


def _seen_rows(config: PreprocessConfig, distinct_ids: int) -> int:
    """A hash or managed table's rows beside its missing row: room for twice the ids seen
    (`table_rows = "ids_seen"`), or all of `hash_size` less that row."""
    if config.table_rows == "hash_size":
        return config.hash_size - 1
    return max(1, min(config.hash_size - 1, 2 * int(distinct_ids)))


def _hash_buckets(con: duckdb.DuckDBPyConnection, config: PreprocessConfig, globs: list[str], feature: str,
                  multi_hot: bool, approx_ids: int) -> int:  # fmt: skip
    """Hash mode's buckets for `feature` under `table_rows = "ids_seen"`: twice its ids, or for a
    feature of few ids the count that keeps them apart (ingestion/bucket_count.py)."""
    if int(approx_ids) > 2 * SEARCHED_IDS:  # the count is approximate: look only where it may be small
        return _seen_rows(config, approx_ids)
    column = quoted(feature)
    each_id = f"unnest({column})" if multi_hot else column  # a bag's every id
    ids = f"(SELECT {each_id} AS id FROM read_parquet(?))"
    seen = con.execute(f"SELECT id, count(*) AS n FROM {ids} WHERE id IS NOT NULL GROUP BY id", [globs]).fetchnumpy()
    return bucket_count(np.asarray(seen["id"]), np.asarray(seen["n"], dtype=np.int64), config.hash_size - 1)


def training_rows(warehouse: Path, train_days: Sequence[int]) -> int:
    """The rows the training days hold: their manifests' count, else their files' footers."""
    rows = 0
    for day in train_days:
        manifest = read_manifest(warehouse, day)
        if manifest and "rows_written" in manifest:
            rows += int(manifest["rows_written"])
        else:
            rows += sum(pq.ParquetFile(path).metadata.num_rows for path in partition_dir(warehouse, day).glob("*.parquet"))
    return rows


def with_fitted_mode(config: PreprocessConfig, warehouse: Path, train_days: Sequence[int]) -> PreprocessConfig:
    """`config` with `categorical_mode = "auto"` resolved by the training days' rows
    (`PreprocessConfig.mode_for`): a state and its id are the resolved mode's, so a config
    that names that mode finds the same state."""
    if config.categorical_mode != "auto":
        return config
    return dataclasses.replace(config, categorical_mode=config.mode_for(training_rows(warehouse, train_days)))


def state_id_for(config: PreprocessConfig, warehouse: Path, train_days: Sequence[int]) -> str:
    """Hash of what the fitted state depends on: the config (its mode resolved) and the
    training days' manifests."""
    config = with_fitted_mode(config, warehouse, train_days)
    manifests = [read_manifest(warehouse, day) for day in sorted(train_days)]
    layouts = [m["layout"] for m in manifests if m and "layout" in m]
    parts = {
        **({"layouts": layouts} if layouts else {}),  # Criteo states keep their ids
        "multi_hot": [m and m.get("multi_hot", []) for m in manifests],
        "version": STATE_VERSION,
        "hash_size": config.hash_size,
        "mode": config.categorical_mode,
        "min_count": config.min_count if config.categorical_mode == "vocab" else None,
        **({"headroom": config.vocab_headroom} if config.categorical_mode == "vocab" else {}),
        **({"table_rows": config.table_rows} if config.table_rows != "ids_seen" else {}),  # earlier states keep their ids
        "days": sorted(train_days),
        "sources": [m and [f["sha256"] for f in m["files"]] for m in manifests],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def fit_state(config: PreprocessConfig, warehouse: Path, features_root: Path, train_days: Sequence[int]) -> PreprocessState:
    """Count distinct values per feature on the training days; reuse a saved state if current."""
    chose_mode = config.categorical_mode == "auto"
    config = with_fitted_mode(config, warehouse, train_days)
    state_id = state_id_for(config, warehouse, train_days)
    state_path = features_root / state_id / "state.json"
    if state_path.is_file():
        log.info("preprocessing state %s is current, reusing it", state_id)
        return PreprocessState.load(state_path)
    globs = [_day_glob(warehouse, day) for day in sorted(train_days)]
    layout = warehouse_layout(warehouse, sorted(train_days))
    multi_hot = layout.multi_hot
    con = connect(config, features_root / "_spill")
    single = [c for c in layout.sparse if c not in multi_hot]
    aggregates = [f"approx_count_distinct({quoted(c)})" for c in single]
    aggregates += [f"avg(greatest(coalesce(len({quoted(c)}), 0), 1))" for c in multi_hot]
    row = con.execute(f"SELECT count(*), avg(label), {', '.join(aggregates)} FROM read_parquet(?)", [globs]).fetchall()[0]
    rows, click_rate = int(row[0]), float(row[1] or 0.0)
    if chose_mode:
        log.info("preprocess.categorical_mode \"auto\": %s (%s training rows%s)", config.categorical_mode, f"{rows:,}",
                 f" are fewer than {FEW_ROWS:,}: every id they saw gets its own row"
                 if config.categorical_mode == "vocab" else "")  # fmt: skip
    counts = dict(zip(single, row[2 : 2 + len(single)]))
    mean_ids = {c: round(float(n or 1.0), 4) for c, n in zip(multi_hot, row[2 + len(single) :])}
    for c in multi_hot:  # distinct ids over every bag
        counts[c] = con.execute(f"SELECT approx_count_distinct(id) FROM (SELECT unnest({quoted(c)}) AS id FROM read_parquet(?))",
                                [globs]).fetchall()[0][0]  # fmt: skip
    state_path.parent.mkdir(parents=True, exist_ok=True)
    table_rows = {}
    if config.categorical_mode == "vocab":
        buckets = _fit_vocabularies(con, config, globs, state_path.parent / "vocab", layout)
        table_rows = {name: min(config.hash_size, n + 2 + math.ceil(n * config.vocab_headroom))
                      for name, n in buckets.items()}  # fmt: skip
    elif config.categorical_mode == "managed":
        # as hash mode sizes its tables: room for twice the ids the training days hold, at most
        # hash_size rows (the last one every id without a row of its own shares)
        table_rows = {name: _seen_rows(config, counts[name]) + 1 for name in layout.sparse}
        buckets = dict(table_rows)
    elif config.table_rows == "ids_seen":
        buckets = {name: _hash_buckets(con, config, globs, name, name in multi_hot, counts[name]) for name in layout.sparse}
    else:
        buckets = {name: _seen_rows(config, counts[name]) for name in layout.sparse}
    state = PreprocessState(state_id, buckets, tuple(sorted(train_days)), rows, click_rate, config.categorical_mode,
                            mean_ids, table_rows, dense=layout.dense, id_types=dict(layout.id_types))  # fmt: skip
    state.save(state_path)  # written last: a state without its vocabularies is never seen
    log.debug("fitted preprocessing state %s on %s rows of days %s", state_id, f"{rows:,}", list(train_days))
    return state


def _fit_vocabularies(con: duckdb.DuckDBPyConnection, config: PreprocessConfig, globs: list[str],
                      folder: Path, layout: FeatureLayout) -> dict[str, int]:  # fmt: skip
    """One Parquet (value, index) per feature; returns each vocabulary's size.

    A multi-hot feature counts every id of every bag.
    """
    folder.mkdir(parents=True, exist_ok=True)
    limit = config.hash_size - 2
    sizes = {}
    for column in layout.sparse:
        path = folder / f"{column}.parquet"
        values = (f"(SELECT unnest({quoted(column)}) AS v FROM read_parquet(?))" if column in layout.multi_hot
                  else f"(SELECT {quoted(column)} AS v FROM read_parquet(?))")  # fmt: skip
        # Most frequent first; ties by value, so the same data always gives the same indices.
        con.execute(
            "COPY (SELECT v AS value, (1 + row_number() OVER (ORDER BY n DESC, v))::INTEGER AS index "
            f"FROM (SELECT v, count(*) AS n FROM {values} WHERE v IS NOT NULL "
            f"GROUP BY v HAVING count(*) >= {int(config.min_count)}) ORDER BY n DESC, v LIMIT {limit}) "
            f"TO '{path}' (FORMAT parquet)",
            [globs],
        )
        sizes[column] = con.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchall()[0][0]
    return sizes


def continue_state(config: PreprocessConfig, parent: PreprocessState, warehouse: Path, features_root: Path,
                   new_days: Sequence[int]) -> PreprocessState:  # fmt: skip
    """The state of a run that continues a model fitted with `parent` on `new_days`.

    Every table keeps its size and every known id its row, so the parent's checkpoint loads
    as it is. Hash mode needs nothing more. Vocabulary mode adds the new days' ids seen at
    least `min_count` times into the table's free rows, most frequent first; once a table is
    full, further new ids share the out-of-vocabulary row until a new lineage refits it.
    The new days' row count and click rate replace the parent's (this run's training rows).
    """
    globs = [_day_glob(warehouse, day) for day in sorted(new_days)]
    con = connect(config, features_root / "_spill")
    rows, click_rate = con.execute("SELECT count(*), avg(label) FROM read_parquet(?)", [globs]).fetchall()[0]
    days = tuple(sorted(new_days))
    continued = dataclasses.replace(parent, train_days=days, train_rows=int(rows), train_click_rate=float(click_rate or 0.0))
    if parent.mode != "vocab":
        return continued
    manifests = [read_manifest(warehouse, day) for day in days]
    sources = [m and [f["sha256"] for f in m["files"]] for m in manifests]
    parts = {"parent": parent.state_id, "days": list(days), "sources": sources, "min_count": config.min_count}
    state_id = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    state_path = features_root / state_id / "state.json"
    if state_path.is_file():
        return dataclasses.replace(PreprocessState.load(state_path), train_rows=int(rows),
                                   train_click_rate=float(click_rate or 0.0), crosses=parent.crosses,
                                   count_bins=parent.count_bins)  # fmt: skip
    folder = state_path.parent / "vocab"
    folder.mkdir(parents=True, exist_ok=True)
    sizes, added, left_out = {}, 0, 0
    for column in parent.buckets:
        known = vocabulary_path(features_root, parent, column)
        if not known.is_file():
            raise PreprocessError(f"{column}: the vocabulary {known} of the model's preprocessing state "
                                  f"{parent.state_id} is gone; a recurring run needs the run folder it was "
                                  "fitted in")  # fmt: skip
        entries = parent.buckets[column]
        free = max(0, parent.table_sizes[column] - 2 - entries)
        values = (f"(SELECT unnest({quoted(column)}) AS v FROM read_parquet(?))" if column in parent.multi_hot
                  else f"(SELECT {quoted(column)} AS v FROM read_parquet(?))")  # fmt: skip
        new_ids = (f"SELECT v, count(*) AS n FROM {values} WHERE v IS NOT NULL AND v NOT IN "
                   f"(SELECT value FROM read_parquet('{known}')) GROUP BY v "
                   f"HAVING count(*) >= {int(config.min_count)}")  # fmt: skip
        candidates = con.execute(f"SELECT count(*) FROM ({new_ids})", [globs]).fetchall()[0][0]
        con.execute(
            f"COPY (SELECT value, index FROM read_parquet('{known}') UNION ALL "
            f"(SELECT v AS value, ({entries + 1} + row_number() OVER (ORDER BY n DESC, v))::INTEGER AS index "
            f"FROM ({new_ids}) ORDER BY n DESC, v LIMIT {free})) TO '{folder / f'{column}.parquet'}' (FORMAT parquet)",
            [globs],
        )
        sizes[column] = entries + min(free, candidates)
        added, left_out = added + min(free, candidates), left_out + max(0, candidates - free)
    state = dataclasses.replace(continued, state_id=state_id, buckets=sizes, parent=parent.state_id)
    state.save(state_path)  # last: a state without its vocabularies is never seen
    log.info("preprocessing state %s continues %s: %s new ids in free rows%s", state_id, parent.state_id, f"{added:,}",
             f", {left_out:,} more share the out-of-vocabulary row (tables full)" if left_out else "")  # fmt: skip
    return state


def vocabulary_path(features_root: Path, state: PreprocessState, feature: str) -> Path:
    return features_root / state.state_id / "vocab" / f"{feature}.parquet"


def feature_sql(state: PreprocessState, features_root: Path | None = None) -> str:
    """The SELECT that turns warehouse rows into features (`{source}` is the input)."""
    dense = [f"ln(1 + greatest(coalesce(s.{quoted(c)}, 0), 0))::FLOAT AS {quoted(c)}" for c in state.dense]
    if state.mode == "managed":  # raw ids: the model's managed-collision modules give them rows
        missing = f"({MISSING_ID + 1} - 1)::BIGINT"  # -2^63 itself is no BIGINT literal
        sparse = [
            f"CASE WHEN coalesce(len(s.{quoted(c)}), 0) = 0 THEN [{missing}] "
            f"ELSE list_transform(s.{quoted(c)}, lambda id: coalesce(id::BIGINT, {missing})) END AS {quoted(c)}"
            if c in state.multi_hot else f"coalesce(s.{quoted(c)}::BIGINT, {missing}) AS {quoted(c)}"
            for c in state.buckets
        ]  # fmt: skip
        return "SELECT s.label::TINYINT AS label, " + ", ".join(dense + sparse) + " FROM {source} s"
    if state.mode != "vocab":
        sparse = [
            f"CASE WHEN coalesce(len(s.{quoted(c)}), 0) = 0 THEN [{MISSING_ROW}] "
            f"ELSE list_transform(s.{quoted(c)}, lambda id: ({_bucket_of('id', c, state)})::INTEGER) END AS {quoted(c)}"
            if c in state.multi_hot else
            f"CASE WHEN s.{quoted(c)} IS NULL THEN {MISSING_ROW} ELSE {_bucket_of(f's.{quoted(c)}', c, state)} END::INTEGER "
            f"AS {quoted(c)}"
            for c in state.buckets
        ]  # fmt: skip
        return "SELECT s.label::TINYINT AS label, " + ", ".join(dense + sparse) + " FROM {source} s"
    # Joins do not keep the input order: the rows are numbered as read and put back in order.
    if features_root is None:
        raise PreprocessError("a vocabulary state needs its features folder to find the vocabularies")
    sparse, joins = [], []
    for i, name in enumerate(state.buckets):
        vocab, c = vocabulary_path(features_root, state, name), quoted(name)
        if name in state.multi_hot:
            # Each id of the bag looked up in order (a correlated subquery DuckDB decorrelates).
            sparse.append(
                f"(SELECT CASE WHEN count(*) = 0 THEN [{MISSING_ROW}] "
                f"ELSE list(coalesce(v.index, {OOV_ROW})::INTEGER ORDER BY u.position) END "
                f"FROM (SELECT unnest(s.{c}) AS id, generate_subscripts(s.{c}, 1) AS position) u "
                f"LEFT JOIN read_parquet('{vocab}') v ON u.id = v.value) AS {c}"
            )
            continue
        sparse.append(f"CASE WHEN s.{c} IS NULL THEN {MISSING_ROW} ELSE coalesce(v{i}.index, {OOV_ROW}) END::INTEGER AS {c}")
        joins.append(f"LEFT JOIN read_parquet('{vocab}') v{i} ON s.{c} = v{i}.value")
    return ("SELECT s.label::TINYINT AS label, " + ", ".join(dense + sparse)
            + " FROM (SELECT *, row_number() OVER () AS source_row FROM {source}) s " + " ".join(joins)
            + " ORDER BY s.source_row")  # fmt: skip


def _bucket_of(value: str, feature: str, state: PreprocessState) -> str:
    """SQL: the table row of a present id `value` in hash mode. Criteo ids are unsigned;
    other integer ids may be negative, and DuckDB's % keeps the dividend's sign."""
    buckets = state.buckets[feature]
    if feature in state.id_types:
        return f"1 + ((({value}) % {buckets}) + {buckets}) % {buckets}"
    return f"1 + ({value} % {buckets})"


def features_dir(features_root: Path, state: PreprocessState, day: int) -> Path:
    return features_root / state.state_id / f"day={day}"


def apply_state(config: PreprocessConfig, state: PreprocessState, warehouse: Path, features_root: Path, day: int) -> Path:
    """Write one day's features atomically; skipped when they already exist for this state."""
    target = features_dir(features_root, state, day)
    if (target / "_done.json").is_file():
        return target
    layout = warehouse_layout(warehouse, [day])
    if set(layout.multi_hot) != set(state.multi_hot):
        raise PreprocessError(f"day {day}: multi-hot features {list(layout.multi_hot) or 'none'} differ from the state's "
                              f"{list(state.multi_hot) or 'none'}; re-ingest the day with the same data.multi_hot")  # fmt: skip
    if (layout.dense, layout.sparse, dict(layout.id_types)) != (state.dense, tuple(state.buckets), state.id_types):
        raise PreprocessError(f"day {day}: its features ({_described(layout)}) are not those the preprocessing "
                              f"state {state.state_id} was fitted on; re-ingest it with the same data settings")  # fmt: skip
    staging = new_staging(features_root / "_tmp", f"day={day}")
    try:
        con = connect(config, features_root / "_spill", keep_order=True)
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
        release(staging).rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.debug("day %d: %s feature rows → %s", day, f"{rows:,}", target)
    return target


def feature_rows(folder: Path) -> int:
    """The rows of a day's features (`apply_state`'s folder)."""
    return int(json.loads((folder / "_done.json").read_text())["rows"])
