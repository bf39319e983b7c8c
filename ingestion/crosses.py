"""Which pairs of categorical columns a regression should cross: a score test against a
fitted model's predictions.

For a pair (a, b) the crosses are one indicator per combined value (a = u, b = v). Adding
them to a logistic regression whose predictions are p, the score (Rao) test of their
weights all being zero is, per combined value c seen in the rows,

    (Σ_{rows with c} (y − p))² / Σ_{rows with c} p (1 − p),

summed over the values: about χ² with one degree of freedom a value when the pair holds
nothing the model has not learned. Values seen fewer than `MIN_COUNT` times are left out
(too few rows to tell a real effect from one row's label).

A pair is crossed when its statistic's χ² tail (degrees of freedom: its values), times the
pairs scored, is at most `FAMILY_P`: the chance that any pair holding nothing is crossed,
whatever the number of pairs tried. The z-score (statistic − values) / √(2 · values), the
threshold before, reads the same tail for every pair, but a χ² of few degrees of freedom has
the longer right tail: z 4 is p 5.1e-4 at 43 values and 5.8e-5 at 2,000, so pairs of few
values were crossed on thinner evidence (docs/run-length.md).

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
import torch

from ingestion.bucket_count import bucket_count
from ingestion.cross_ids import Cross, combined_keys

MIN_COUNT = 5  # a combined value counts toward its pair's score once seen this often
FAMILY_P = 0.05  # the chance, over every pair scored, that a pair holding nothing is crossed
MOST_PAIRS = 12  # at most this many pairs crossed, the strongest


@dataclass(frozen=True)
class PairScore:
    """The score test of crossing columns `first` and `second` (their indexes)."""

    first: int
    second: int
    z: float  # (statistic − values) / √(2 · values); about standard normal when the pair adds nothing
    statistic: float
    values: int  # combined values seen at least MIN_COUNT times
    p: float  # the statistic's χ² tail at `values` degrees of freedom: its chance when the pair adds nothing


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
        z = (statistic - values) / np.sqrt(2 * max(values, 1))
        scores.append(PairScore(a, b, z, statistic, values, chi_square_tail(statistic, values)))
    return sorted(scores, key=_strongest_first)


def chi_square_tail(statistic: float, degrees: int) -> float:
    """P(χ²(degrees) ≥ statistic): the regularized upper incomplete gamma Q(k/2, x/2); 1 where
    no value was seen often enough to score."""
    if degrees < 1:
        return 1.0
    half_degrees, half_statistic = (torch.tensor(x / 2.0, dtype=torch.float64) for x in (degrees, statistic))
    return float(torch.special.gammaincc(half_degrees, half_statistic))


def chosen_pairs(scores: list[PairScore], family_p: float = FAMILY_P, most: int = MOST_PAIRS) -> list[tuple[int, int]]:
    """The pairs whose tail, times the pairs scored (Bonferroni), is at most `family_p`; the
    `most` strongest (the smallest tail; the largest z where tails underflow to 0)."""
    tried = len(scores)
    return [(score.first, score.second) for score in sorted(scores, key=_strongest_first)
            if score.p * tried <= family_p][:most]  # fmt: skip


def _strongest_first(score: PairScore) -> tuple[float, float]:
    return score.p, -score.z


def feature_pairs(train_files: Sequence[str], features: Sequence[str], out_of_fold: np.ndarray,
                  family_p: float = FAMILY_P, most: int = MOST_PAIRS) -> list[tuple[str, str]]:  # fmt: skip
    """The pairs of one-id `features` of the feature files to cross, by name: scored on the
    rows that `out_of_fold` predicts (its length is the files' rows, in their order; NaN
    where no fit left the row out). Bag features (lists of ids) are not paired."""
    labels, columns = _single_columns(train_files, features)
    return _chosen_names(labels, columns, out_of_fold, family_p, most)


def choose_crosses(train_files: Sequence[str], features: Sequence[str], out_of_fold: np.ndarray, most_rows: int,
                   family_p: float = FAMILY_P, most: int = MOST_PAIRS) -> tuple[Cross, ...]:  # fmt: skip
    """`feature_pairs`' pairs as crosses, strongest first, each with the table rows
    (`cross_table_rows`, at most `most_rows`) its combinations in the files need."""
    labels, columns = _single_columns(train_files, features)
    pairs = _chosen_names(labels, columns, out_of_fold, family_p, most)
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


def _chosen_names(labels: np.ndarray, columns: dict[str, np.ndarray], out_of_fold: np.ndarray, family_p: float,
                  most: int) -> list[tuple[str, str]]:  # fmt: skip
    if len(labels) != len(out_of_fold):
        raise ValueError(f"{len(out_of_fold):,} out-of-fold predictions for {len(labels):,} rows of the feature files")
    names = list(columns)
    scored = np.isfinite(out_of_fold)
    if len(names) < 2 or not scored.any():
        return []
    codes = np.stack([columns[name][scored] for name in names], axis=1)
    pairs = chosen_pairs(pair_scores(codes, labels[scored], out_of_fold[scored]), family_p, most)
    return [(names[a], names[b]) for a, b in pairs]


def _is_bag(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)
