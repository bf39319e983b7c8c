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

The pipeline does not cross columns yet: `bench/chosen_crosses.py` chooses pairs with this
test and measures what crossing them is worth to a regression, on generated and real data
(docs/run-length.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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
        _, combined = np.unique(indexes[a] * sizes[b] + indexes[b], return_inverse=True)
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
    columns: dict[str, list[np.ndarray | None]] = {name: [] for name in ("label", *features)}
    for path in train_files:
        table = pq.read_table(path, columns=list(columns))
        for name, parts in columns.items():
            parts.append(None if _is_bag(table.schema.field(name).type) else table.column(name).to_numpy())
    singles = [name for name in features if all(part is not None for part in columns[name])]
    labels = np.concatenate(columns["label"]).astype(np.float64)
    if len(labels) != len(out_of_fold):
        raise ValueError(f"{len(out_of_fold):,} out-of-fold predictions for {len(labels):,} rows of the feature files")
    scored = np.isfinite(out_of_fold)
    codes = np.stack([np.concatenate(columns[name]).astype(np.int64)[scored] for name in singles], axis=1)
    pairs = chosen_pairs(pair_scores(codes, labels[scored], out_of_fold[scored]), z, most)
    return [(singles[a], singles[b]) for a, b in pairs]


def _is_bag(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)
