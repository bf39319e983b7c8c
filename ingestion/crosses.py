"""Which pairs of categorical columns a regression should cross: a score test against a
fitted model's predictions.

For a pair (a, b) the crosses are one indicator per combined value (a = u, b = v). Adding
them to a logistic regression whose predictions are p, the score (Rao) test of their
weights all being zero is, per combined value c seen in the rows,

    (Σ_{rows with c} (y − p))² / Σ_{rows with c} p (1 − p),

summed over the values: about χ² with one degree of freedom a value when the pair holds
nothing the model has not learned. Values seen fewer than `MIN_COUNT` times are left out
(too few rows to tell a real effect from one row's label). The z-score
(statistic − values) / √(2 · values) then ranks pairs of any number of values together.

The predictions must come from a model that did not train on the rows scored (out of fold):
on its own training rows a regression's residuals are fitted to zero per value of each
column, and a pair would be scored against that overfit.

`choose_crosses` turns the chosen pairs into crosses (ingestion/cross_ids.py), each with a
table sized so that its frequent combinations keep rows of their own; a run crosses them
when `model.crosses = "auto"` (flows/run/crosses.py). `bench/chosen_crosses.py` measures
what crossing them is worth to a regression, on generated and real data (docs/run-length.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ingestion.bucket_count import bucket_count
from ingestion.cross_ids import Cross, combined_keys

MIN_COUNT = 5  # a combined value counts toward its pair's score once seen this often
CHOSEN_Z = 4.0  # the lowest z-score a pair is crossed at
MOST_PAIRS = 12  # at most this many pairs crossed, the strongest


@dataclass(frozen=True)
class PairScore:
    """The score test of crossing columns `first` and `second` (their indexes)."""

    first: int
    second: int
    z: float  # (statistic − values) / √(2 · values); about standard normal when the pair adds nothing
    statistic: float
    values: int  # combined values seen at least MIN_COUNT times


def pair_scores(codes: np.ndarray, labels: np.ndarray, predictions: np.ndarray, min_count: int = MIN_COUNT) -> list[PairScore]:
    """Every pair of the columns of `codes` ([rows, columns] integers: any code per value,
    equal values equal codes), scored against `predictions` (out of fold), strongest first."""
    codes = np.asarray(codes)
    labels, predictions = np.asarray(labels, dtype=np.float64), np.asarray(predictions, dtype=np.float64)
    if codes.ndim != 2 or len(codes) != len(labels) or len(labels) != len(predictions):
        raise ValueError(f"codes [rows, columns], labels and predictions of one length: got {codes.shape}, "
                         f"{labels.shape}, {predictions.shape}")  # fmt: skip
    residual, weight = labels - predictions, predictions * (1.0 - predictions)
    # each column's values as 0..k−1, so that a pair's combined value is one int64
    dense = [np.unique(codes[:, column], return_inverse=True) for column in range(codes.shape[1])]
    indexes = [inverse.reshape(-1).astype(np.int64) for _, inverse in dense]
    sizes = [len(values) for values, _ in dense]
    scores = []
    for a, b in itertools.combinations(range(codes.shape[1]), 2):
        combined = indexes[a] * sizes[b] + indexes[b]
        if sizes[a] * sizes[b] > 4 * len(combined) + 65_536:  # sparse combinations: count the ones seen
            _, combined = np.unique(combined, return_inverse=True)
        count = np.bincount(combined)
        sums, weights = np.bincount(combined, residual), np.bincount(combined, weight)
        seen = count >= min_count
        values = int(seen.sum())
        statistic = float((sums[seen] ** 2 / np.maximum(weights[seen], 1e-12)).sum())
        scores.append(PairScore(a, b, (statistic - values) / np.sqrt(2 * max(values, 1)), statistic, values))
    return sorted(scores, key=lambda score: -score.z)


def chosen_pairs(scores: list[PairScore], z: float = CHOSEN_Z, most: int = MOST_PAIRS) -> list[tuple[int, int]]:
    """The pairs scored at or above `z`, the `most` strongest."""
    return [(score.first, score.second) for score in sorted(scores, key=lambda s: -s.z) if score.z >= z][:most]


def feature_pairs(train_files: Sequence[str], features: Sequence[str], out_of_fold: np.ndarray, z: float = CHOSEN_Z,
                  most: int = MOST_PAIRS) -> list[tuple[str, str]]:  # fmt: skip
    """The pairs of one-id `features` of the feature files to cross, by name: scored on the
    rows that `out_of_fold` predicts (its length is the files' rows, in their order; NaN
    where no fit left the row out). Bag features (lists of ids) are not paired."""
    labels, columns = _single_columns(train_files, features)
    return _chosen_names(labels, columns, out_of_fold, z, most)


def choose_crosses(train_files: Sequence[str], features: Sequence[str], out_of_fold: np.ndarray, most_rows: int,
                   z: float = CHOSEN_Z, most: int = MOST_PAIRS) -> tuple[Cross, ...]:  # fmt: skip
    """`feature_pairs`' pairs as crosses, strongest first, each with the table rows
    (`cross_table_rows`, at most `most_rows`) its combinations in the files need."""
    labels, columns = _single_columns(train_files, features)
    pairs = _chosen_names(labels, columns, out_of_fold, z, most)
    return tuple(Cross(a, b, cross_table_rows(columns[a], columns[b], most_rows)) for a, b in pairs)


def cross_table_rows(first_rows: np.ndarray, second_rows: np.ndarray, most_rows: int) -> int:
    """Rows for a cross of these two columns (each training row's ids): from twice the
    combinations seen, the fewest at which none seen often shares a row with a more frequent
    one, as a hashed feature's table is sized (ingestion/bucket_count.py)."""
    keys, counts = np.unique(combined_keys(first_rows, second_rows), return_counts=True)
    return bucket_count(keys, counts.astype(np.int64), max(1, most_rows))


def _single_columns(train_files: Sequence[str], features: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The files' labels, and their one-id columns among `features` (bags left out), in file order."""
    columns: dict[str, list[np.ndarray | None]] = {name: [] for name in ("label", *features)}
    for path in train_files:
        table = pq.read_table(path, columns=list(columns))
        for name, parts in columns.items():
            parts.append(None if _is_bag(table.schema.field(name).type) else table.column(name).to_numpy())
    singles = {name: np.concatenate(parts).astype(np.int64) for name, parts in columns.items()  # type: ignore[arg-type]
               if name != "label" and all(part is not None for part in parts)}  # fmt: skip
    return np.concatenate(columns["label"]).astype(np.float64), singles  # type: ignore[arg-type]


def _chosen_names(labels: np.ndarray, columns: dict[str, np.ndarray], out_of_fold: np.ndarray, z: float,
                  most: int) -> list[tuple[str, str]]:  # fmt: skip
    if len(labels) != len(out_of_fold):
        raise ValueError(f"{len(out_of_fold):,} out-of-fold predictions for {len(labels):,} rows of the feature files")
    names = list(columns)
    scored = np.isfinite(out_of_fold)
    if len(names) < 2 or not scored.any():
        return []
    codes = np.stack([columns[name][scored] for name in names], axis=1)
    pairs = chosen_pairs(pair_scores(codes, labels[scored], out_of_fold[scored]), z, most)
    return [(names[a], names[b]) for a, b in pairs]


def _is_bag(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)
