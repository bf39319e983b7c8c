"""Configuration of the data stages: where logs come from, the warehouse, preprocessing.

Validation errors are `ValueError("key: problem")`; the loader prefixes the section path.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ingestion.days import DayError, day_value, is_date, parse_day
from ingestion.schema import RESERVED_COLUMNS, check_multi_hot

_COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A run on fewer training rows than this is a few-row run: `categorical_mode = "auto"` looks its
# ids up in a vocabulary (below), and training/model/small_data.py starts its model as the
# fitted logistic regression (Avazu's 8,000 rows did better both ways, MovieLens's 66,000 worse)
FEW_ROWS = 32_768


@dataclass(frozen=True)
class SyntheticConfig:
    """The generator of Criteo-format days (demo, tests, benchmarks)."""

    rows_per_day: int = 200_000
    """examples per generated day (`demo.toml` sets 300,000)"""
    seed: int = 7
    """the generator's seed: the same seed gives the same days"""
    # Kaggle Criteo cardinalities times this factor (at least 3 values per feature).
    cardinality_scale: float = 0.05
    """Kaggle Criteo's per-feature cardinalities times this (at least 3 values a feature); in (0, 1]"""
    click_rate: float = 0.25
    """the share of positive labels; in [0.01, 0.99]"""
    # Mean ids per example of a multi-hot feature (`data.multi_hot`), when present.
    multi_hot_mean_ids: float = 8.0
    """mean ids in a bag of a `multi_hot` feature: bags hold 1 + Poisson(mean − 1) ids"""
    # Every effect of the ground truth (per value, pairwise, dense) times this factor. 1: the
    # demo's strong signal (Bayes-optimal NE near 0.65); 0.55: weak, like real logs (Bayes NE
    # 0.86–0.87; 0.45 gives 0.90). The bias is re-solved, so the click rate stays `click_rate`.
    signal_scale: float = 1.0
    """every effect of the ground-truth model times this. 1: the demo's strong signal (Bayes-optimal NE near 0.65); 0.55: weak,
    like real logs (Bayes-optimal NE about 0.86; 0.45 gives about 0.90). The click rate stays `click_rate`"""
    # Drift from day to day (0: every day has one ground truth). `signal_drift`: radians a
    # day by which every effect turns toward an independent one, so effects k days apart
    # correlate by cos(k × signal_drift) (0.15: a week apart 0.49; pairwise terms, products of
    # two effects, by its square): what a model learnt goes
    # stale. `id_lifetime_days`: each value is logged under an id that lives this many days,
    # then gives way to a new id with effects of its own (each day 1/lifetime of a feature's
    # ids is new and as many stop, at every popularity; features of fewer than 1,000 values,
    # a device or a country, keep theirs); 0: ids live for ever.
    signal_drift: float = 0.0
    """radians a day by which every effect turns toward an independent one: effects k days apart correlate by cos(k × drift),
    pairwise terms by its square (0.15: a week apart, 0.49). What a model learnt goes stale"""
    id_lifetime_days: int = 0
    """each value is logged under an id that lives this many days, then gives way to a new id with effects of its own; every day
    1/lifetime of each feature's ids is new and as many stop, at every popularity; features of fewer than 1,000 values (a
    device, a country) keep theirs (`configs/drifting-ids.toml`). 0: ids live for ever"""

    def __post_init__(self) -> None:
        if self.rows_per_day <= 0:
            raise ValueError(f"rows_per_day: must be positive, got {self.rows_per_day}")
        if not 0.0 < self.cardinality_scale <= 1.0:
            raise ValueError(f"cardinality_scale: must be in (0, 1], got {self.cardinality_scale}")
        if not 0.01 <= self.click_rate <= 0.99:
            raise ValueError(f"click_rate: must be in [0.01, 0.99], got {self.click_rate}")
        if not 1.0 <= self.multi_hot_mean_ids <= 1000.0:
            raise ValueError(f"multi_hot_mean_ids: must be in [1, 1000], got {self.multi_hot_mean_ids}")
        if not 0.0 <= self.signal_scale <= 10.0:
            raise ValueError(f"signal_scale: must be in [0, 10], got {self.signal_scale}")
        if not 0.0 <= self.signal_drift <= math.pi:
            raise ValueError(f"signal_drift: radians a day in [0, π], got {self.signal_drift}")
        if self.id_lifetime_days < 0:
            raise ValueError(f"id_lifetime_days: days (0: ids live for ever), got {self.id_lifetime_days}")


@dataclass(frozen=True)
class DataConfig:
    """Raw logs and the Parquet warehouse. Relative paths are taken from the run directory."""

    # "synthetic": generated Criteo days; "files": Criteo TSV files (`files`); "parquet":
    # the user's own hive-partitioned Parquet dataset (`path`, `partition`, `label`,
    # `dense`, `sparse`).
    source: Literal["synthetic", "files", "parquet"] = "synthetic"
    """`synthetic`: generate Criteo-format days; `files`: ingest the Criteo files in `files`; `parquet`: your own
    hive-partitioned Parquet dataset (`path`, `partition`, `label`, `dense`, `sparse`; README: Your own warehouse)"""
    # Real Criteo files (plain or gzip, local paths or fsspec URLs). A file's day comes from
    # a `day_N` in its name, otherwise from its position in this list.
    files: tuple[str, ...] = ()
    """Criteo files, plain or gzip, local paths or fsspec URLs, or local glob patterns (`/data/criteo/day_*.gz`, expanded at each
    run, so new days are seen). A file's day comes from `day_N` in its name or its folder's, otherwise from its position in
    the list. Needed when `source = "files"`"""
    raw_dir: str = "raw"
    """where generated days are written"""
    warehouse_dir: str = "warehouse"
    """the Parquet warehouse (`day=N/` partitions, `_quarantine/`, `_manifest.json`)"""
    # Days: integers, or ISO dates ("2026-11-24") naming a dated warehouse's partitions; held
    # as integers (dates: days since 1970-01-01, `normalised`), shown as written (`shown`).
    train_days: tuple[int, ...] = (0, 1)
    """the days the model trains on (and preprocessing is fitted on): integers, or ISO dates (`"2026-11-24"`) naming a dated
    `parquet` source's partitions"""
    eval_days: tuple[int, ...] = (2,)
    """the held-out days it is judged on; must not overlap `train_days`"""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # Categorical features with a variable number of ids per example: their raw field holds
    # comma-separated ids and their warehouse column is a list (e.g. ["C3", "C12"]).
    multi_hot: tuple[str, ...] = ()
    """categorical features that hold a bag of ids per example, e.g. `["C3", "C12"]`: their raw field holds comma-separated 8-hex
    ids and their warehouse column is a list. Criteo sources only: a `parquet` source finds its lists by their type"""
    # When a day of `files` is complete, for `dlrm run --as-of newest` (the nightly run):
    # a marker file beside the day's files (`{file}` stands for each file's name, e.g.
    # "{file}.done"; "_SUCCESS" for a folder per day) and/or the newest N days still held
    # back as being written. Both empty/0: every day with a file is complete.
    complete_marker: str = ""
    """when a day of `files` (or a partition of `path`) counts as complete for `dlrm run --as-of newest` (the nightly run): a
    file of this name beside each of the day's files; `{file}` stands for the file's name (`"{file}.done"`), or use
    `"_SUCCESS"` with a folder per day. Empty: every day with a file is complete"""
    complete_delay_days: int = 0
    """the newest N days present are taken as still being written and are not yet the newest"""
    # source = "parquet": a folder or fsspec URL holding `{partition}=VALUE/*.parquet`; the
    # 0/1 label column (bool or integer); numeric columns; id columns (integer or string
    # ids, or lists of them: multi-hot). Each column's name is its feature's name.
    path: str = ""
    """`source = "parquet"`: the dataset's folder (relative: from `run_dir`) or fsspec URL (`s3://bucket/clicks`), holding one
    `{partition}=VALUE/` folder of Parquet files a day. Only the partitions a run needs are listed and read, each file
    streamed in record batches of the configured columns"""
    partition: str = "ds"
    """the partition column: its values are the days, integers (`ds=3`) or ISO dates (`ds=2026-11-24`)"""
    label: str = "label"
    """the 0/1 label column, bool or integer. A row with a null or other label is quarantined"""
    dense: tuple[str, ...] = ()
    """numeric columns (at least one): missing → 0, then `ln(1 + max(x, 0))`; a NaN or ±inf is quarantined"""
    sparse: tuple[str, ...] = ()
    """id columns: integer ids, text ids (stored as the FNV-1a hash of their UTF-8 bytes), or lists of either (multi-hot, null
    ids dropped). Each gets an embedding table named after the column. A float column of whole numbers counts as integer ids;
    a fractional one is quarantined. A column missing or of another kind than on earlier days stops that day, naming the
    column and both types"""
    # How days are written: "auto" (in the TOML) takes dates when the configured days are ISO dates.
    day_format: Literal["integer", "date"] = "integer"
    """how days are written: `"auto"` takes ISO dates when `train_days` are dates; `"integer"` or `"date"` to say so. Dates count
    internally as days since 1970-01-01, so "the days before N" is the same for both"""

    @classmethod
    def normalised(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The TOML form with its days as integers and `day_format` "auto" decided by how
        the days are written (configs, the command line and summaries keep writing them so)."""
        days = {key: raw.get(key, getattr(cls, key)) for key in ("train_days", "eval_days")}
        if not all(isinstance(value, (list, tuple)) for value in days.values()):
            return raw  # the type check names the key
        if raw.get("day_format", "auto") == "auto":
            kinds = {is_date(day) for value in days.values() for day in value}
            if len(kinds) > 1:
                raise ValueError("train_days: mixes integers and dates; write every day the same way")
            raw["day_format"] = "date" if kinds == {True} else "integer"
        try:
            return {**raw, **{key: [parse_day(day) for day in value] for key, value in days.items()}}
        except DayError as error:
            raise ValueError(f"train_days: {error}") from None

    def __post_init__(self) -> None:
        if not all(isinstance(day, int) and not isinstance(day, bool) for day in (*self.train_days, *self.eval_days)):
            raise ValueError("train_days: days are integers here (ISO dates are read from the TOML)")
        if self.source == "parquet":
            self._check_parquet_columns()
        elif self.day_format == "date":
            raise ValueError("train_days: ISO dates name the partitions of source = 'parquet'; Criteo days are integers")
        if self.source != "parquet" or self.multi_hot:
            check_multi_hot(self.multi_hot)
        if self.complete_delay_days < 0:
            raise ValueError(f"complete_delay_days: must be ≥ 0, got {self.complete_delay_days}")
        if "/" in self.complete_marker:
            raise ValueError(f"complete_marker: a file name beside the day's files, got {self.complete_marker!r}")
        if not self.train_days:
            raise ValueError("train_days: needs at least one day")
        if not self.eval_days:
            raise ValueError("eval_days: needs at least one day")
        overlap = sorted(set(self.train_days) & set(self.eval_days))
        if overlap:
            raise ValueError(f"eval_days: {overlap} also in train_days; held-out days must differ")
        if self.source == "files" and not self.files:
            raise ValueError("files: source = 'files' needs a list of Criteo files")

    @property
    def all_days(self) -> tuple[int, ...]:
        return tuple(sorted({*self.train_days, *self.eval_days}))

    @property
    def dated(self) -> bool:
        return self.day_format == "date"

    def shown(self, day: int) -> int | str:
        """A day as configs, the command line and summaries write it (a date, or the integer)."""
        return day_value(day, self.dated)

    def shown_days(self, days: Sequence[int]) -> list[int | str]:
        return [self.shown(day) for day in days]

    def day_label(self, day: int) -> str:
        """A day as text: names of its files, metrics and artifacts (`2026-11-24`, or `3`)."""
        return str(self.shown(day))

    def _check_parquet_columns(self) -> None:
        if not self.path:
            raise ValueError("path: source = 'parquet' needs the dataset's folder or URL")
        if self.multi_hot:
            raise ValueError("multi_hot: a Parquet source finds its multi-hot features by their list columns; remove it")
        if not self.sparse:
            raise ValueError("sparse: source = 'parquet' needs at least one id column")
        if not self.dense:
            raise ValueError("dense: source = 'parquet' needs at least one numeric column (the DLRM's bottom MLP "
                             "takes them); a constant column will do")  # fmt: skip
        named = {"partition": [self.partition], "label": [self.label], "dense": list(self.dense),
                 "sparse": list(self.sparse)}  # fmt: skip
        for key, names in named.items():
            for name in names:
                if not _COLUMN_NAME.fullmatch(name):
                    raise ValueError(f"{key}: {name!r} is not a plain column name (letters, digits, _)")
        features = [*self.dense, *self.sparse]
        repeated = sorted({name for name in features if features.count(name) > 1} | ({self.label} & set(features))
                          | ({self.partition} & {self.label, *features}))  # fmt: skip
        if repeated:
            raise ValueError(f"sparse: {repeated} named twice (label, partition, dense and sparse columns differ)")
        reserved = sorted(set(features) & set(RESERVED_COLUMNS))
        if reserved:
            raise ValueError(f"dense: {reserved} are names the pipeline uses itself; rename those columns in a view")


@dataclass(frozen=True)
class ManagedIdsConfig:
    """`categorical_mode = "managed"`: how ids win and lose their rows (training/model/managed_ids.py).

    Each table (`hash_size` rows at most) gives its rows to the ids it admits; the last row is
    shared by every id without one. Every `eviction_interval` training steps (and before each
    checkpoint and at a run's end) the ids seen since the last round are counted: those seen
    at least `admit_min_count` times are candidates, and `policy` picks the residents they
    replace: "lfu" the least used since admitted, "lru" the longest unseen, "distance_lfu"
    uses divided by the rounds since seen (both).
    """

    policy: Literal["lfu", "lru", "distance_lfu"] = "lru"
    """which resident ids new ones replace: `lru` the longest unseen, `lfu` the least used since admitted (a tie keeps the
    resident), `distance_lfu` uses divided by the rounds since seen"""
    eviction_interval: int = 100
    """training steps between admission rounds (also one before each checkpoint and at a run's end): the ids seen since the last
    round are counted and the candidates admitted"""
    admit_min_count: int = 1
    """the fewest sightings in a round that make an id a candidate; rarer ids share the last row"""

    def __post_init__(self) -> None:
        if self.eviction_interval < 1:
            raise ValueError(f"eviction_interval: training steps between rounds, at least 1, got {self.eviction_interval}")
        if self.admit_min_count < 1:
            raise ValueError(f"admit_min_count: at least 1, got {self.admit_min_count}")


@dataclass(frozen=True)
class PreprocessConfig:
    """DuckDB feature preprocessing: log-transformed dense features; categoricals hashed or
    looked up in a vocabulary fitted on the training days."""

    # No embedding table has more rows than this (row 0 of each is kept for missing values).
    hash_size: int = 100_000
    """the most rows any embedding table has (row 0 of each is the missing value)"""
    # "hash": 1 + value mod buckets. "vocab": values seen at least `min_count` times on the
    # training days get their own row (the most frequent first, at most hash_size - 2 of
    # them); every other value shares the out-of-vocabulary row 1.
    # "managed": each id keeps its raw value and a managed-collision module in front of the
    # table admits new ids and evicts stale ones (`managed`): for ids that come and go.
    # "auto": vocab on fewer than FEW_ROWS training rows, else hash (`mode_for`).
    categorical_mode: Literal["auto", "hash", "vocab", "managed"] = "auto"
    """`auto`: `vocab` when the training days hold fewer than 32,768 rows (an id they never saw then shares the
    out-of-vocabulary row, whose weight no training row moves, instead of a seen id's hash row), else `hash`; `hash` where
    `table_rows = "hash_size"` (docs/run-length.md). `hash`: 1 + value mod buckets. `vocab`: values seen at least
    `min_count` times on the training days get their own row, most frequent first (at most `hash_size` − 2 of them); every
    other value shares the out-of-vocabulary row 1. Vocabularies are Parquet files beside the state. `managed`: the features
    keep each raw id (missing: the id −2^63) and a TorchRec managed-collision module in front of each table admits new ids
    and evicts stale ones as training goes (`[preprocess.managed]`); tables sized as in hash mode, the last row shared by
    every id without one (docs/managed-ids.md)"""
    min_count: int = 1
    """the fewest sightings that earn a value its own row in `vocab` mode"""
    # Vocabulary mode: free table rows beyond the fitted vocabulary, as a fraction of it (up
    # to hash_size rows in all). A recurring run (`--as-of`) gives new frequent ids these
    # rows and keeps every existing id's row; with none left, new ids share row 1.
    vocab_headroom: float = 0.5
    """`vocab` mode: free table rows beyond the fitted vocabulary, as a fraction of it (at most `hash_size` rows in all). A
    recurring run (`--as-of`) puts the new days' frequent ids there, keeping every known id's row; once a table is full, new
    ids share the out-of-vocabulary row until a new lineage refits (docs/recurring.md)"""
    # Hash and managed modes: how many rows each table gets. "ids_seen": room for twice the
    # distinct ids the training days hold (at most hash_size), so small features don't pay
    # for hash_size rows; in hash mode a feature of few ids gets the fewest buckets from
    # there that keep them apart (ingestion/bucket_count.py). "hash_size": every table hash_size rows, as a production hash table
    # is sized: room for the ids later nights bring, fewer collisions as they come.
    table_rows: Literal["ids_seen", "hash_size"] = "ids_seen"
    """hash and managed modes: each table's rows. `ids_seen`: twice the distinct ids the training days hold, at most
    `hash_size`, so small features don't pay for a full table (in hash mode a feature of few ids gets the fewest buckets
    from there that keep its frequent ids apart: at twice the ids, two of three values would share a row four times in
    ten); `hash_size`: every table `hash_size` rows, as a production hash table is sized (room for the ids later nights
    bring: a recurring lineage keeps its first state's table sizes). Vocab mode sizes its tables by `vocab_headroom`"""
    managed: ManagedIdsConfig = field(default_factory=ManagedIdsConfig)
    features_dir: str = "features"
    """where feature Parquet and the versioned preprocessing state go"""
    duckdb_memory_limit: str = "2GB"
    """DuckDB's memory limit"""
    duckdb_threads: int = 2
    """DuckDB's threads"""
    row_group_size: int = 131_072
    """rows per Parquet row group of the features (at least 1,024); the reader hands row groups to ranks"""

    def __post_init__(self) -> None:
        if self.hash_size < 2:
            raise ValueError(f"hash_size: must be at least 2, got {self.hash_size}")
        if self.categorical_mode == "vocab" and self.hash_size < 3:
            raise ValueError("hash_size: vocabulary mode needs at least 3 (missing, out-of-vocabulary, one value)")
        if not 0.0 <= self.vocab_headroom <= 100.0:
            raise ValueError(f"vocab_headroom: must be in [0, 100], got {self.vocab_headroom}")
        if self.min_count < 1:
            raise ValueError(f"min_count: must be at least 1, got {self.min_count}")
        if self.table_rows == "hash_size" and self.categorical_mode == "vocab":
            raise ValueError("table_rows: \"hash_size\" sizes hash and managed tables; vocab mode sizes its tables by "
                             "vocab_headroom (set categorical_mode = \"hash\", or leave table_rows = \"ids_seen\")")
        if self.duckdb_threads < 1:
            raise ValueError(f"duckdb_threads: must be at least 1, got {self.duckdb_threads}")
        if self.row_group_size < 1024:
            raise ValueError(f"row_group_size: must be at least 1024, got {self.row_group_size}")

    def mode_for(self, train_rows: int) -> str:
        """The categorical mode of a state fitted on `train_rows` rows: the configured one, or
        for `auto` a vocabulary on few rows (every id they saw its own row and an unseen one
        no seen id's row, as a one-hot regression has it; docs/run-length.md measures it) and
        hash tables on more (room for the ids of later nights)."""
        if self.categorical_mode != "auto":
            return self.categorical_mode
        few = train_rows < FEW_ROWS and self.table_rows == "ids_seen" and self.hash_size >= 3
        return "vocab" if few else "hash"
