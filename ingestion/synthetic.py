"""Criteo-format days with realistic statistics and a known ground truth.

Each example's click probability comes from a logistic model over per-value latent effects
of the categoricals, pairwise categorical interactions and log-scaled dense counts. Because
the true probability of every row is known, each day also gets its Bayes-optimal NE: the
best normalized entropy any model can reach on exactly those rows.

`signal_scale` multiplies every effect. At 1 the signal is strong (Bayes-optimal NE near
0.65: the demo); near 0.55, with full cardinalities and a few thousand rows a day, days look
like a small real sample (Bayes NE 0.85–0.9, most ids seen once: configs/small-real.toml).

Value frequencies follow a power law per feature; cardinalities are Kaggle Criteo's scaled
by `cardinality_scale`. Every per-value quantity is a hash of (feature, value), so days
share one ground truth without storing tables of millions of values.

Days can drift (`signal_drift`: every effect turns a little each day toward an independent
one; `id_lifetime_days`: each value is logged under an id that is replaced after so many
days, staggered so that a share of every feature's ids is new each day). At the defaults
every day shares one ground truth, byte for byte as before these settings existed.

A multi-hot feature holds a bag of 1 + Poisson(mean − 1) ids drawn from its power law (or
none, when empty); its effects are the sum over the bag divided by √mean, which a
sum-pooled embedding can represent exactly.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ingestion.config import SyntheticConfig
from ingestion.schema import (
    DENSE_COLUMNS,
    MULTI_HOT_SEPARATOR,
    NUM_DENSE,
    NUM_SPARSE,
    RAW_COLUMNS,
    SPARSE_COLUMNS,
    check_multi_hot,
)

KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CHUNK_ROWS = 131_072
# Bump when the generative model changes: days written by another version are not reused.
GENERATOR_VERSION = 2
# Byte value → its two lowercase hex characters, as one little-endian uint16.
_HEX_PAIRS = np.array(
    [int.from_bytes(f"{b:02x}".encode(), "little") for b in range(256)], dtype=np.uint16
)
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# With `id_lifetime_days`, the features with at least this many values have ids that come and go.
CHURNING_VALUES = 1_000
# Salts of the drift's second effect draw and of an id's replacement phase.
_DRIFT_SALT = np.uint64(0xD81F7A5EC0FFEE11)
_PHASE_SALT = np.uint64(0x1D11FE7133AA55CC)
# A multi-hot feature's bags: feature index → (ids per row [rows], the ranks of all ids).
Bags = dict[int, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class DayStats:
    """What the generator knows about one day it wrote."""

    day: int
    generator: str  # version and config the day was written with
    rows: int
    clicks: int
    click_rate: float
    bayes_ne: float
    bayes_log_loss: float
    dense_empty_fraction: float
    sparse_empty_fraction: float


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer: decorrelates (feature, value) keys into uniform bits."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


def _normal_table(seed: int) -> np.ndarray:
    """65,536 standard normals: hashed keys index into it instead of drawing per value."""
    return np.random.default_rng([seed, 0x7AB1E]).standard_normal(1 << 16).astype(np.float32)


class GroundTruth:
    """The fixed generative model behind every day of one seed."""

    NUM_PAIRS = 12  # categorical pairs whose latent vectors interact (what LR cannot learn)
    PAIR_WEIGHT = 0.45

    def __init__(self, config: SyntheticConfig, multi_hot: Sequence[str] = (), bias: float | None = None) -> None:
        """`bias`: the one `_calibrate_bias` gives this config, kept from an earlier build
        (`shared_ground_truth`); calibrated here when not given."""
        self.config = config
        self.multi_hot = check_multi_hot(multi_hot)
        self.multi_hot_index = tuple(SPARSE_COLUMNS.index(name) for name in self.multi_hot)
        rng = np.random.default_rng([config.seed, 0xC1])
        scaled = np.array(KAGGLE_CARDINALITIES, dtype=np.float64) * config.cardinality_scale
        self.cardinality = np.maximum(3, np.round(scaled)).astype(np.int64)
        self.zipf_exponent = rng.uniform(1.05, 1.35, NUM_SPARSE)
        self.sparse_missing = rng.beta(0.6, 4.8, NUM_SPARSE)  # mean ≈ 0.11
        # `signal_scale` scales the effects after every draw: the random stream, hence the ids
        # and dense counts of a day, is the same at any scale (and × 1.0 is exact).
        signal = config.signal_scale
        self.sparse_scale = signal * rng.choice([0.0, 0.1, 0.25, 0.45], NUM_SPARSE, p=[0.15, 0.3, 0.35, 0.2])
        self.dense_missing = rng.beta(1.0, 4.0, NUM_DENSE)  # mean ≈ 0.2
        self.dense_log_mean = rng.uniform(0.0, 4.0, NUM_DENSE)
        self.dense_log_sd = rng.uniform(0.5, 1.5, NUM_DENSE)
        self.dense_weight = signal * rng.normal(0.0, 0.25, NUM_DENSE)
        pairs = rng.choice(NUM_SPARSE, size=(self.NUM_PAIRS, 2), replace=True)
        self.pairs = [(int(a), int(b)) for a, b in pairs if a != b]
        self.pair_weight = signal * self.PAIR_WEIGHT
        self.latent_dim = 4
        self.feature_salt = rng.integers(1, 2**62, NUM_SPARSE, dtype=np.int64)
        self.normals = _normal_table(config.seed)
        # the dense weights a drifting ground truth turns toward (its own stream: the days'
        # random draws stay those of a ground truth without drift)
        self.dense_weight_drift = signal * np.random.default_rng([config.seed, 0xD81F7]).normal(0.0, 0.25, NUM_DENSE)
        self.bias = 0.0
        self.bias = self._calibrate_bias(config.click_rate) if bias is None else bias

    def sample_ranks(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        """Power-law value ranks per feature, -1 where the cell is empty. [rows, 26] int64."""
        ranks = np.empty((rows, NUM_SPARSE), dtype=np.int64)
        for j in range(NUM_SPARSE):
            k, s = float(self.cardinality[j]), self.zipf_exponent[j]
            u = rng.random(rows)
            # inverse CDF of a continuous power law on [1, k + 1), shifted to ranks 0..k-1
            x = ((k + 1.0) ** (1.0 - s) - 1.0) * u + 1.0
            ranks[:, j] = np.minimum(x ** (1.0 / (1.0 - s)) - 1.0, k - 1).astype(np.int64)
            ranks[rng.random(rows) < self.sparse_missing[j], j] = -1
        return ranks

    def sample_bags(self, rng: np.random.Generator, ranks: np.ndarray) -> Bags:
        """Bags of the multi-hot features: the row's rank in `ranks` first, then more draws;
        an empty cell (rank −1) gets an empty bag."""
        bags: Bags = {}
        for j in self.multi_hot_index:
            present = ranks[:, j] >= 0
            lengths = np.where(present, 1 + rng.poisson(self.config.multi_hot_mean_ids - 1.0, len(ranks)), 0)
            extra = self._power_law_ranks(rng, j, int(lengths.sum() - present.sum()))
            flat = np.empty(int(lengths.sum()), dtype=np.int64)
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            first = starts[present]
            flat[first] = ranks[present, j]
            is_extra = np.ones(len(flat), dtype=bool)
            is_extra[first] = False
            flat[is_extra] = extra
            bags[j] = (lengths, flat)
        return bags

    def _power_law_ranks(self, rng: np.random.Generator, feature: int, n: int) -> np.ndarray:
        k, s = float(self.cardinality[feature]), self.zipf_exponent[feature]
        x = ((k + 1.0) ** (1.0 - s) - 1.0) * rng.random(n) + 1.0
        return np.minimum(x ** (1.0 / (1.0 - s)) - 1.0, k - 1).astype(np.int64)

    def sample_dense(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        """Integer counts per feature; I2 can be negative as in real logs; NaN = empty."""
        logs = rng.normal(self.dense_log_mean, self.dense_log_sd, size=(rows, NUM_DENSE))
        counts = np.floor(np.expm1(np.maximum(logs, 0.0)))
        counts[:, 1] -= 3.0
        counts[rng.random((rows, NUM_DENSE)) < self.dense_missing] = np.nan
        return counts

    def logits(self, ranks: np.ndarray, dense: np.ndarray, bags: Bags | None = None, day: int = 0) -> np.ndarray:
        """Each row's logit on `day` (which a drifting ground truth depends on)."""
        bags = bags or {}
        z = np.full(ranks.shape[0], self.bias, dtype=np.float64)
        value_hash = [self._value_hash(bags[j][1] if j in bags else ranks[:, j], j, day) for j in range(NUM_SPARSE)]
        turn = self.config.signal_drift * day

        def effect(j: int, slot: int) -> np.ndarray:
            if j not in bags:
                return self._turned_effect(value_hash[j], ranks[:, j], slot, turn)
            lengths, flat = bags[j]
            rows_of = np.repeat(np.arange(len(lengths)), lengths)
            each = self._turned_effect(value_hash[j], flat, slot, turn)
            pooled = np.bincount(rows_of, weights=each, minlength=len(lengths))
            return pooled / math.sqrt(self.config.multi_hot_mean_ids)

        for j in range(NUM_SPARSE):
            if self.sparse_scale[j] > 0:
                z += self.sparse_scale[j] * effect(j, 0)
        for a, b in self.pairs:
            dot = np.zeros(ranks.shape[0], dtype=np.float64)
            for d in range(self.latent_dim):
                dot += effect(a, 1 + d) * effect(b, 1 + self.latent_dim + d)
            z += self.pair_weight * dot / math.sqrt(self.latent_dim)
        log_dense = np.log1p(np.maximum(np.nan_to_num(dense, nan=0.0), 0.0))
        dense_weight = self.dense_weight
        if turn:
            dense_weight = math.cos(turn) * self.dense_weight + math.sin(turn) * self.dense_weight_drift
        z += (log_dense - self.dense_log_mean) @ dense_weight
        return z

    def value_keys(self, ranks: np.ndarray, feature: int, day: int) -> np.ndarray:
        """The key of the id each value is logged under on `day`: its rank, and with
        `id_lifetime_days` the id's generation, which turns over on a day of its own per value.
        Only features of at least `CHURNING_VALUES` values churn (users, items, ads); a
        device or a country keeps its id."""
        keys = ranks.astype(np.uint64)
        lifetime = self.config.id_lifetime_days
        if not lifetime or self.cardinality[feature] < CHURNING_VALUES:
            return keys
        phase = _splitmix64(keys ^ _PHASE_SALT ^ np.uint64(self.feature_salt[feature])) % np.uint64(lifetime)
        generation = (np.uint64(day) + phase) // np.uint64(lifetime)
        return keys | (generation << np.uint64(40))  # ranks stay below 2^40

    def _value_hash(self, ranks: np.ndarray, feature: int, day: int) -> np.ndarray:
        return _splitmix64(self.value_keys(ranks, feature, day) ^ np.uint64(self.feature_salt[feature]))

    def _turned_effect(self, value_hash: np.ndarray, ranks: np.ndarray, slot: int, turn: float) -> np.ndarray:
        """The effect turned by `turn` radians toward an independent draw (none: unchanged)."""
        effect = self._effect(value_hash, ranks, slot)
        if not turn:
            return effect
        other = self._effect(_splitmix64(value_hash ^ _DRIFT_SALT), ranks, slot)
        return np.float32(math.cos(turn)) * effect + np.float32(math.sin(turn)) * other

    def _effect(self, value_hash: np.ndarray, ranks: np.ndarray, slot: int) -> np.ndarray:
        """Latent effect number `slot` of each value; an empty cell contributes nothing.

        Slots take different 16-bit windows of one 64-bit hash (rotated for slots > 3).
        """
        shift = np.uint64((16 * slot) % 64)
        rotated = (value_hash >> shift) | (value_hash << (np.uint64(64) - shift)) if shift else value_hash
        index = (rotated ^ (rotated >> np.uint64(29 + slot))) & np.uint64(0xFFFF)
        return np.where(ranks >= 0, self.normals[index], np.float32(0.0))

    def hex_ids(self, ranks: np.ndarray, feature: int, day: int = 0) -> np.ndarray:
        """The 32-bit id a value is logged as on `day` (Criteo logs hashed ids, not ranks)."""
        key = self.value_keys(ranks, feature, day) + (np.uint64(self.feature_salt[feature]) << np.uint64(1))
        return (_splitmix64(key) & np.uint64(0xFFFFFFFF)).astype(np.uint32)

    def _calibrate_bias(self, click_rate: float) -> float:
        """Solve for the bias that gives the target mean click probability on a pilot sample."""
        rng = np.random.default_rng([self.config.seed, 0xB1A5])
        ranks, dense = self.sample_ranks(rng, 100_000), self.sample_dense(rng, 100_000)
        z = self.logits(ranks, dense, self.sample_bags(rng, ranks))
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(z + mid)))) < click_rate:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


def _hex_column(ids: np.ndarray, empty: np.ndarray) -> pa.Array:
    """uint32 ids → 8 lowercase hex characters, null where empty; vectorised."""
    big_endian_bytes = ids.astype(">u4").view(np.uint8).reshape(-1, 4)  # [rows, 4]
    data = pa.py_buffer(_HEX_PAIRS[big_endian_bytes])  # [rows, 4] pairs = 8 chars each
    offsets = pa.py_buffer(np.arange(0, 8 * (len(ids) + 1), 8, dtype=np.int32))
    validity = pa.py_buffer(np.packbits(~empty, bitorder="little")) if empty.any() else None
    return pa.Array.from_buffers(pa.string(), len(ids), [validity, offsets, data])


def _hex_list_column(ids: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A bag of uint32 ids per row → the ids in hex joined by the separator, null if empty."""
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    bags = pa.ListArray.from_arrays(offsets, _hex_column(ids, np.zeros(len(ids), dtype=bool)), mask=pa.array(lengths == 0))
    return pc.binary_join(bags, MULTI_HOT_SEPARATOR)


def generate_chunk(truth: GroundTruth, rng: np.random.Generator, rows: int, day: int = 0) -> tuple[pa.Table, np.ndarray]:
    """One chunk of `day`'s raw rows as an Arrow table of the 40 Criteo fields, and each row's p."""
    ranks = truth.sample_ranks(rng, rows)
    dense = truth.sample_dense(rng, rows)
    bags = truth.sample_bags(rng, ranks)
    probability = 1.0 / (1.0 + np.exp(-truth.logits(ranks, dense, bags, day)))
    labels = (rng.random(rows) < probability).astype(np.int8)
    columns: list[pa.Array] = [pa.array(labels)]
    for i in range(NUM_DENSE):
        empty = np.isnan(dense[:, i])
        columns.append(pa.array(np.nan_to_num(dense[:, i]).astype(np.int64), mask=empty))
    for j in range(NUM_SPARSE):
        if j in bags:
            lengths, flat = bags[j]
            columns.append(_hex_list_column(truth.hex_ids(flat, j, day), lengths))
        else:
            columns.append(_hex_column(truth.hex_ids(ranks[:, j], j, day), ranks[:, j] < 0))
    return pa.Table.from_arrays(columns, names=list(RAW_COLUMNS)), probability


@functools.lru_cache(maxsize=8)
def shared_ground_truth(config: SyntheticConfig, multi_hot: tuple[str, ...] = (), kept_in: Path | None = None) -> GroundTruth:
    """`GroundTruth(config, multi_hot)`, built once per process: its construction calibrates
    the bias on a 100,000-row pilot sample (0.35 s of CPU), more work than a small day. A
    ground truth is not changed after it is built, so one serves every day and every run of
    the process.

    `kept_in` (the user's cache, given by the commands): a folder where each config's
    calibrated bias is kept, so that the next process builds the same ground truth without
    the pilot. An entry is named by a digest of the generator's fingerprint, this module's
    code and numpy's version (a change to either calibrates again); one that cannot be read
    is calibrated again and replaced, and a folder that cannot be written only costs the
    next process its pilot."""
    entry = kept_in / f"{_bias_digest(config, multi_hot)}.json" if kept_in is not None else None
    kept = _read_bias(entry) if entry is not None else None
    truth = GroundTruth(config, multi_hot, bias=kept)
    if entry is not None and kept is None:
        with contextlib.suppress(OSError):
            entry.parent.mkdir(parents=True, exist_ok=True)
            staged = entry.with_name(f".{entry.name}.{os.getpid()}-{threading.get_ident()}.staged")
            staged.write_text(json.dumps({"generator": generator_fingerprint(config, multi_hot), "bias": truth.bias}))
            os.replace(staged, entry)  # a reader sees a whole entry
    return truth


def _bias_digest(config: SyntheticConfig, multi_hot: Sequence[str]) -> str:
    digest = hashlib.sha256(f"{generator_fingerprint(config, multi_hot)}|numpy {np.__version__}|".encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:32]


def _read_bias(entry: Path) -> float | None:
    try:
        bias = json.loads(entry.read_text())["bias"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(bias) if isinstance(bias, float) and math.isfinite(bias) else None


def generate_day(
    config: SyntheticConfig, day: int, out_dir: Path, truth: GroundTruth | None = None, multi_hot: Sequence[str] = ()
) -> DayStats:
    """Write `day_{day}.tsv.gz` and `day_{day}.stats.json` into `out_dir`.

    `multi_hot` (or `truth`'s, when given) names the features written as bags of ids.
    """
    truth = truth or shared_ground_truth(config, tuple(multi_hot))
    rng = np.random.default_rng([config.seed, day])
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"day_{day}.tsv.gz"
    partial = target.with_suffix(".gz.partial")
    sums = np.zeros(5)  # rows, clicks, log loss (nats), empty dense cells, empty sparse cells
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    # gzip level 1 in a second thread (zlib releases the GIL): compression overlaps generation.
    with gzip.open(partial, "wb", compresslevel=1) as sink, ThreadPoolExecutor(1) as writer:
        pending = None
        for start in range(0, config.rows_per_day, CHUNK_ROWS):
            rows = min(CHUNK_ROWS, config.rows_per_day - start)
            table, p = generate_chunk(truth, rng, rows, day)
            text = pa.BufferOutputStream()
            pacsv.write_csv(table, text, options)
            if pending is not None:
                pending.result()
            pending = writer.submit(sink.write, text.getvalue())
            y = table["label"].to_numpy()
            sums += (
                rows,
                y.sum(),
                -np.sum(np.where(y == 1, np.log(p), np.log1p(-p))),
                sum(table[c].null_count for c in DENSE_COLUMNS),
                sum(table[c].null_count for c in SPARSE_COLUMNS),
            )
        if pending is not None:
            pending.result()
    partial.replace(target)
    stats = _day_stats(day, sums, generator_fingerprint(config, truth.multi_hot))
    (out_dir / f"day_{day}.stats.json").write_text(json.dumps(asdict(stats), indent=2))
    return stats


# Settings added after GENERATOR_VERSION 2: described only when not at their default, so
# days written before they existed (byte-identical at the default) keep their fingerprint.
_LATER_SETTINGS = {"signal_scale": 1.0, "signal_drift": 0.0, "id_lifetime_days": 0}


def generator_fingerprint(config: SyntheticConfig, multi_hot: Sequence[str] = ()) -> str:
    described = {k: v for k, v in asdict(config).items() if _LATER_SETTINGS.get(k, object()) != v}
    if multi_hot:  # absent otherwise, so single-hot days keep their fingerprint
        described["multi_hot"] = list(check_multi_hot(multi_hot))
    return f"v{GENERATOR_VERSION}:" + json.dumps(described, sort_keys=True)


def _day_stats(day: int, sums: np.ndarray, generator: str) -> DayStats:
    rows, clicks, log_loss, dense_empty, sparse_empty = sums
    ctr = clicks / rows
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)) if 0 < ctr < 1 else float("nan")
    return DayStats(
        day=day,
        generator=generator,
        rows=int(rows),
        clicks=int(clicks),
        click_rate=float(ctr),
        bayes_ne=float(log_loss / rows / entropy),
        bayes_log_loss=float(log_loss / rows),
        dense_empty_fraction=float(dense_empty / (rows * NUM_DENSE)),
        sparse_empty_fraction=float(sparse_empty / (rows * NUM_SPARSE)),
    )


def read_day_stats(raw_dir: Path, day: int) -> DayStats | None:
    path = raw_dir / f"day_{day}.stats.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return DayStats(**data) if set(data) == {f.name for f in fields(DayStats)} else None


def existing_day(config: SyntheticConfig, raw_dir: Path, day: int, multi_hot: Sequence[str] = ()) -> DayStats | None:
    """The stats of a day already written with exactly this generator and config, if any."""
    stats = read_day_stats(raw_dir, day)
    current = stats is not None and stats.generator == generator_fingerprint(config, multi_hot)
    return stats if current and (raw_dir / f"day_{day}.tsv.gz").is_file() else None
