"""Which counts to cut into bins: a score test against a fitted regression's out-of-fold
predictions, as the crossed pairs are chosen (ingestion/crosses.py).

A regression sees a dense feature as one weight on ln(1 + x). Adding its bins' indicators
(ingestion/count_bins.py), the score (Rao) test of their weights all being zero is, per bin
b seen at least `MIN_COUNT` times,

    (Σ_{rows in b} (y − p))² / Σ_{rows in b} p (1 − p),

summed over the bins: about χ² with one degree of freedom a bin when the line already
holds the count's effect (a conservative count: the bins together also span the bias and
the line). A count is cut when its tail, times the counts scored, is at most `FAMILY_P`.
The predictions must be out of fold, as for the pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from ingestion.count_bins import CountBins, bin_rows, quantile_edges
from ingestion.crosses import FAMILY_P, MIN_COUNT, chi_square_tail


@dataclass(frozen=True)
class BinScore:
    """The score test of cutting dense feature `feature` at `edges`."""

    feature: str
    edges: tuple[float, ...]
    statistic: float
    bins: int  # bins seen at least MIN_COUNT times
    p: float  # the statistic's χ² tail at `bins` degrees of freedom


def bin_score(bins: np.ndarray, labels: np.ndarray, predictions: np.ndarray, min_count: int = MIN_COUNT) -> tuple[float, int]:
    """The statistic and its degrees of freedom for the bin column `bins` ([rows] ints)."""
    labels, predictions = np.asarray(labels, dtype=np.float64), np.asarray(predictions, dtype=np.float64)
    residual, weight = labels - predictions, predictions * (1.0 - predictions)
    count = np.bincount(bins)
    sums, weights = np.bincount(bins, residual, len(count)), np.bincount(bins, weight, len(count))
    seen = count >= min_count
    return float((sums[seen] ** 2 / np.maximum(weights[seen], 1e-12)).sum()), int(seen.sum())


def count_scores(labels: np.ndarray, dense: dict[str, np.ndarray], out_of_fold: np.ndarray) -> list[BinScore]:
    """Each dense column of `dense` (its training rows' values, as the model sees them) cut
    at its quantiles and scored against `out_of_fold` (NaN where no fit left the row out); a
    column of fewer than two bins is not scored."""
    if any(len(values) != len(out_of_fold) for values in dense.values()) or len(labels) != len(out_of_fold):
        raise ValueError(f"{len(out_of_fold):,} out-of-fold predictions for {len(labels):,} rows of the feature files")
    scored = np.isfinite(out_of_fold)
    scores = []
    for feature, values in dense.items():
        edges = quantile_edges(values)
        if not edges or not scored.any():
            continue
        statistic, bins = bin_score(bin_rows(values[scored], edges), labels[scored], out_of_fold[scored])
        scores.append(BinScore(feature, edges, statistic, bins, chi_square_tail(statistic, bins)))
    return scores


def chosen_counts(scores: list[BinScore], family_p: float = FAMILY_P) -> tuple[CountBins, ...]:
    """The counts whose tail, times the counts scored (Bonferroni), is at most `family_p`, in
    the files' order."""
    return tuple(CountBins(s.feature, s.edges) for s in scores if s.p * len(scores) <= family_p)


def choose_count_bins(train_files: Sequence[str], dense: Sequence[str], out_of_fold: np.ndarray,
                      family_p: float = FAMILY_P) -> tuple[list[BinScore], tuple[CountBins, ...]]:  # fmt: skip
    """The scores of the feature files' `dense` columns (their rows in file order, as
    `out_of_fold` predicts them) and the counts to cut."""
    labels, columns = [], {name: [] for name in dense}
    for path in train_files:
        table = pq.read_table(path, columns=["label", *dense])
        labels.append(table.column("label").to_numpy())
        for name in dense:
            columns[name].append(table.column(name).to_numpy())
    values = {name: np.concatenate(parts).astype(np.float32) for name, parts in columns.items()}
    scores = count_scores(np.concatenate(labels).astype(np.float64), values, out_of_fold)
    return scores, chosen_counts(scores, family_p)
