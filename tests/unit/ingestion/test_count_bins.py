"""Counts cut into bins (ingestion/count_bins.py) and which counts are cut
(ingestion/count_bin_choice.py): the bins, their edges, and the score test checked against
per-bin sums in pandas, scipy's χ² tail and scikit-learn's out-of-fold regression."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pandas as pd
import pytest
from scipy.stats import chi2
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_predict

from ingestion.count_bin_choice import bin_score, chosen_counts, count_scores
from ingestion.count_bins import CountBins, bin_rows, count_bins_from, quantile_edges


def test_a_values_bin_is_the_number_of_edges_at_or_below_it() -> None:
    edges = (0.5, 1.0, 2.5)
    values = np.array([0.0, 0.49, 0.5, 0.99, 1.0, 2.4, 2.5, 9.0], dtype=np.float32)
    assert bin_rows(values, edges).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert bin_rows(values, edges).dtype == np.int64
    assert bin_rows(values, ()).tolist() == [0] * len(values), "no edges: one bin"
    bins = CountBins("I1", edges)
    assert (bins.name, bins.rows) == ("I1_bins", 4)


def test_a_float32_value_on_an_edge_lands_in_the_same_bin_in_training_and_serving() -> None:
    """Edges come from float32 values (the feature files'); a served value computed in
    float64 and stored as float32 (champion_pyfunc.dense_features) bins the same."""
    x = np.float32(np.log(1.0 + 7.0))
    edges = quantile_edges(np.repeat(np.array([0.0, x, 5.0], dtype=np.float32), 400), most_bins=3)
    assert x in np.asarray(edges, dtype=np.float32)
    served = np.array([np.log(1.0 + 7.0)], dtype=np.float64).astype(np.float32)
    assert bin_rows(served, edges)[0] == bin_rows(np.array([x]), edges)[0] == 1


def test_quantile_edges_give_bins_of_about_equal_rows_and_merge_equal_quantiles() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(2.0, 1.0, 6_400).astype(np.float32)
    edges = quantile_edges(values)
    assert len(edges) == 31 and list(edges) == sorted(edges), "32 bins of 200 rows"
    counts = np.bincount(bin_rows(values, edges), minlength=32)
    assert counts.min() >= 190 and counts.max() <= 210
    assert len(quantile_edges(values[:1_000])) == 4, "200 rows a bin at least: 5 bins"
    mostly_zero = np.where(rng.random(6_400) < 0.9, 0.0, rng.exponential(3.0, 6_400)).astype(np.float32)
    cut = quantile_edges(mostly_zero)
    assert 0.0 not in cut and 1 <= len(cut) <= 4, "the 90 % at 0 share bin 0"
    assert (bin_rows(mostly_zero[mostly_zero == 0], cut) == 0).all() and bin_rows(mostly_zero, cut).max() == len(cut)
    assert quantile_edges(np.full(6_400, 3.0, dtype=np.float32)) == (), "a constant has one bin"
    assert quantile_edges(values[:399]) == (), "too few rows for two bins"


def test_count_bins_round_trip_through_their_json_form() -> None:
    bins = (CountBins("age", (0.5, 1.25)), CountBins("I13", (2.0,)))
    assert count_bins_from([asdict(b) for b in bins]) == bins


def test_the_bin_statistic_is_the_sum_over_bins_of_the_squared_residual_over_its_variance() -> None:
    rng = np.random.default_rng(1)
    bins = rng.integers(0, 6, 3_000)
    bins[bins == 5] = rng.integers(0, 5, int((bins == 5).sum()))  # bin 5 never seen
    bins[:3] = 5  # seen three times: under MIN_COUNT, left out
    p = rng.uniform(0.05, 0.6, 3_000)
    y = (rng.random(3_000) < p + 0.05 * (bins == 2)).astype(np.float64)
    frame = pd.DataFrame({"bin": bins, "r": y - p, "w": p * (1 - p)})
    frame = frame.groupby("bin").agg(r=("r", "sum"), w=("w", "sum"), n=("r", "size"))
    seen = frame[frame.n >= 5]
    statistic, degrees = bin_score(bins, y, p)
    assert degrees == len(seen) == 5
    assert statistic == pytest.approx(float((seen.r**2 / seen.w).sum()), rel=1e-12)


def _bent_data(rows: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A label bent in `bent` (highest midway), straight in `straight`, blind to `noise`."""
    rng = np.random.default_rng(seed)
    counts = {name: rng.uniform(0.0, 4.0, rows).astype(np.float32) for name in ("bent", "straight", "noise")}
    logit = -1.0 + 0.6 * counts["straight"] - 1.2 * (counts["bent"] - 2.0) ** 2 + 1.0
    return (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float64), counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_bent_count_is_cut_and_a_straight_one_is_not(seed: int) -> None:
    """Scored against scikit-learn's out-of-fold predictions of the regression on the three
    counts as straight lines: only the bent count's bins hold what it misses."""
    labels, counts = _bent_data(8_000, seed)
    design = np.stack(list(counts.values()), axis=1)
    out_of_fold = cross_val_predict(LogisticRegression(C=1.0), design, labels, cv=5, method="predict_proba")[:, 1]
    scores = count_scores(labels, counts, out_of_fold)
    assert [s.feature for s in scores] == ["bent", "straight", "noise"]
    for score in scores:
        assert score.p == pytest.approx(chi2.sf(score.statistic, score.bins), rel=1e-9, abs=1e-300)
        assert score.bins == len(score.edges) + 1 == 32
    chosen = chosen_counts(scores)
    assert [b.feature for b in chosen] == ["bent"], [(s.feature, s.p) for s in scores]
    assert chosen[0].edges == scores[0].edges


def test_rows_no_fit_left_out_are_not_scored_and_the_lengths_must_agree() -> None:
    """The edges are every training row's quantiles; the test scores only the rows some fit
    left out (the others' predictions are NaN)."""
    labels, counts = _bent_data(4_000, 3)
    predictions = np.full(4_000, labels.mean())
    predictions[:2_000] = np.nan
    for score in count_scores(labels, counts, predictions):
        values = counts[score.feature]
        assert score.edges == quantile_edges(values) and len(score.edges) == 19, "4,000 rows: 20 bins of 200"
        expected = bin_score(bin_rows(values[2_000:], score.edges), labels[2_000:], predictions[2_000:])
        assert (score.statistic, score.bins) == expected
    with pytest.raises(ValueError, match="out-of-fold predictions for"):
        count_scores(labels[:10], {k: v[:10] for k, v in counts.items()}, predictions)
