"""A count cut into bins: one more id column, computed from a dense feature.

A dense feature reaches a logistic regression (and a wide part started as one) as one
weight on ln(1 + x): a straight line. A count whose effect bends (an age that peaks midway,
a capital gain that matters only once it is large) gets a weight a bin as well: the bins
are the feature's quantiles over the training rows, and each row's bin is one id of a table
of `rows` rows (ingestion/count_bin_choice.py chooses which counts to cut). The bin is never
written to the feature files: the reader (training) and the served model (serving) compute it
from the dense value the model sees, ln(1 + max(x, 0)) as float32, the same way, here. It
imports numpy only: the served model bundles this file.

A value's bin is the number of edges at or below it: bin 0 holds the values under the first
edge (a missing count, 0, among them), bin k those from edge k on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SUFFIX = "_bins"  # a count's bins' name: "<feature>_bins", its KJT key and table
MOST_BINS = 32  # at most this many bins a count
ROWS_A_BIN = 200  # and as many as give each bin this many training rows


@dataclass(frozen=True)
class CountBins:
    """Dense feature `feature` cut at `edges` (ascending, on the model's ln(1 + x) scale)."""

    feature: str
    edges: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.feature}{SUFFIX}"

    @property
    def rows(self) -> int:
        return len(self.edges) + 1


def bin_rows(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """[n] int64: each value's bin (its table row). `values` as the model sees them (float32)."""
    return np.searchsorted(np.asarray(edges, dtype=np.float64), np.asarray(values, dtype=np.float32).astype(np.float64),
                           side="right").astype(np.int64)  # fmt: skip


def quantile_edges(values: np.ndarray, most_bins: int = MOST_BINS, rows_a_bin: int = ROWS_A_BIN) -> tuple[float, ...]:
    """The edges of at most `most_bins` bins of about equal rows (at least `rows_a_bin` each)
    over `values` (the training rows'); equal quantiles merge, so a count mostly 0 gets fewer
    bins. No edges (one bin) where the values cannot fill two."""
    x = np.asarray(values, dtype=np.float32).astype(np.float64)
    bins = min(most_bins, len(x) // max(rows_a_bin, 1))
    if bins < 2 or len(x) == 0:
        return ()
    edges = np.unique(np.quantile(x, np.arange(1, bins) / bins, method="lower"))
    return tuple(float(edge) for edge in edges[edges > x.min()])  # an edge at the minimum leaves bin 0 empty


def count_bins_from(records: Sequence[dict]) -> tuple[CountBins, ...]:
    """Count bins from their JSON form (a preprocessing state, a served model's description)."""
    return tuple(CountBins(str(r["feature"]), tuple(float(e) for e in r["edges"])) for r in records)
