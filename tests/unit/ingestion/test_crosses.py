"""ingestion/crosses.py: the score test that ranks pairs of categorical columns, against a
brute-force count, on a planted interaction, and on data that holds none."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest

from ingestion.crosses import FAMILY_P, PairScore, chi_square_tail, chosen_pairs, pair_scores


def _brute_force(codes: np.ndarray, labels: np.ndarray, p: np.ndarray, min_count: int) -> dict[tuple[int, int], float]:
    """The statistic of every pair, summed over the combined values as text, row by row."""
    statistics = {}
    for a, b in itertools.combinations(range(codes.shape[1]), 2):
        rows: dict[str, list[int]] = defaultdict(list)
        for i in range(len(labels)):
            rows[f"{codes[i, a]}|{codes[i, b]}"].append(i)
        total = 0.0
        for members in rows.values():
            if len(members) >= min_count:
                total += sum(labels[i] - p[i] for i in members) ** 2 / sum(p[i] * (1 - p[i]) for i in members)
        statistics[(a, b)] = total
    return statistics


def _planted(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Five columns; the label's log-odds has each column's own effect and, for columns 1
    and 3 only, an effect of their combination. The predictions are a regression's without
    crosses (scikit-learn, one-hot columns), each row's from the fit of the folds without it."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_predict
    from sklearn.preprocessing import OneHotEncoder

    rng = np.random.default_rng(seed)
    cardinality = [3, 4, 5, 6, 8]
    codes = np.stack([rng.integers(0, k, rows) for k in cardinality], axis=1)
    own = sum(rng.normal(0, 0.5, k)[codes[:, c]] for c, k in enumerate(cardinality)) - 1.0
    pair = rng.normal(0, 0.8, (cardinality[1], cardinality[3]))[codes[:, 1], codes[:, 3]]
    labels = (rng.random(rows) < 1 / (1 + np.exp(-(own + pair)))).astype(np.int64)
    one_hot = OneHotEncoder().fit_transform(codes)
    out_of_fold = cross_val_predict(LogisticRegression(C=1.0, max_iter=1000), one_hot, labels, cv=5, method="predict_proba")
    return codes, labels, out_of_fold[:, 1]


def test_the_statistic_is_the_sum_over_combined_values_seen_often_enough() -> None:
    rng = np.random.default_rng(1)
    codes = np.stack([rng.integers(0, 4, 400), rng.integers(0, 3, 400), rng.integers(0, 30, 400)], axis=1)
    labels = rng.integers(0, 2, 400)
    p = rng.uniform(0.1, 0.9, 400)
    expected = _brute_force(codes, labels, p, min_count=5)
    scores = pair_scores(codes, labels, p, min_count=5)
    assert [s.z for s in scores] == sorted((s.z for s in scores), reverse=True)
    for score in scores:
        assert score.statistic == pytest.approx(expected[(score.first, score.second)], rel=1e-10)
        assert score.z == pytest.approx((score.statistic - score.values) / np.sqrt(2 * score.values))
    # columns 0 and 1 make 12 values, each seen about 33 times; 0 and 2 make up to 120, most seen fewer than 5 times
    by_pair = {(s.first, s.second): s for s in scores}
    assert by_pair[(0, 1)].values == 12 and by_pair[(0, 2)].values < 60


def test_the_planted_pair_is_chosen_and_no_other() -> None:
    codes, labels, p = _planted(20_000)
    scores = pair_scores(codes, labels, p)
    assert (scores[0].first, scores[0].second) == (1, 3) and scores[0].z > 40 and scores[0].p < 1e-12, scores[0]
    assert all(abs(s.z) < 4 and s.p * len(scores) > FAMILY_P for s in scores[1:]), scores[1:]
    assert chosen_pairs(scores) == [(1, 3)]


def test_on_data_without_interactions_the_scores_look_standard_normal() -> None:
    rng = np.random.default_rng(2)
    codes = np.stack([rng.integers(0, k, 30_000) for k in (2, 3, 4, 5, 6, 7, 8, 9)], axis=1)
    p = rng.uniform(0.05, 0.5, 30_000)
    labels = (rng.random(30_000) < p).astype(np.int64)
    z = np.array([s.z for s in pair_scores(codes, labels, p)])
    assert len(z) == 28 and abs(z.mean()) < 0.6 and 0.5 < z.std() < 1.6, z
    assert chosen_pairs(pair_scores(codes, labels, p)) == []


def test_any_integer_codes_give_the_same_scores() -> None:
    """Ids as the warehouse holds them (large, negative) score as their ranks do."""
    codes, labels, p = _planted(3_000, seed=3)
    ids = codes.astype(np.int64) * 7_919_000_000_003 - 2**62
    assert pair_scores(ids, labels, p) == pair_scores(codes, labels, p)


def test_the_strongest_pairs_within_the_family_wise_tail_are_chosen() -> None:
    """Ten pairs scored: a pair is chosen when ten times its tail is at most 0.05; among tails
    that underflow to 0, the larger z is the stronger."""
    scores = [PairScore(0, 1, 3.9, 0.0, 1, 0.006), PairScore(0, 2, 9.0, 0.0, 1, 1e-9), PairScore(1, 2, 5.0, 0.0, 1, 1e-4),
              PairScore(2, 3, 4.0, 0.0, 1, 0.005), PairScore(1, 3, 90.0, 0.0, 1, 0.0), PairScore(0, 3, 80.0, 0.0, 1, 0.0),
              *(PairScore(4, n, 0.0, 0.0, 1, 0.5) for n in range(5, 9))]  # fmt: skip
    assert chosen_pairs(scores) == [(1, 3), (0, 3), (0, 2), (1, 2), (2, 3)]
    assert chosen_pairs(scores, most=2) == [(1, 3), (0, 3)]
    assert chosen_pairs(scores, family_p=1e-5) == [(1, 3), (0, 3), (0, 2)]


def test_the_tail_is_the_chi_square_survival_function() -> None:
    """Against scipy (an independent implementation), at few and many degrees of freedom,
    and the two readings of z 4 that made the z-score a loose threshold for few values."""
    from scipy.stats import chi2

    for statistic, degrees in ((3.84, 1), (10.0, 3), (100.0, 43), (43 + 4 * np.sqrt(86), 43), (2_000 + 4 * np.sqrt(4_000), 2_000),
                               (5_000.0, 1_500)):  # fmt: skip
        assert chi_square_tail(statistic, degrees) == pytest.approx(chi2.sf(statistic, degrees), rel=1e-6, abs=1e-300)
    assert chi_square_tail(43 + 4 * np.sqrt(86), 43) > 5 * chi_square_tail(2_000 + 4 * np.sqrt(4_000), 2_000)
    assert chi_square_tail(5.0, 0) == 1.0


def test_rows_that_do_not_line_up_are_refused() -> None:
    with pytest.raises(ValueError, match="one length"):
        pair_scores(np.zeros((10, 3), dtype=np.int64), np.zeros(10), np.zeros(9))


def test_bags_of_ids_are_not_paired_and_predictions_must_cover_the_rows(multi_hot_features) -> None:
    """Every pair of one-id features, none with a bag (any predictions will do: every pair is kept)."""
    import pyarrow.parquet as pq

    from ingestion.crosses import feature_pairs
    from tests.conftest import TINY_MULTI_HOT

    state, files = multi_hot_features
    train_files = [*files[0], *files[1]]
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in train_files)
    predictions = np.random.default_rng(4).uniform(0.1, 0.4, rows)
    every = feature_pairs(train_files, list(state.table_sizes), predictions, family_p=np.inf, most=10_000)
    singles = len(state.table_sizes) - len(TINY_MULTI_HOT)
    assert len(every) == singles * (singles - 1) // 2
    assert not {name for pair in every for name in pair} & set(TINY_MULTI_HOT)
    with pytest.raises(ValueError, match="out-of-fold predictions for"):
        feature_pairs(train_files, list(state.table_sizes), predictions[:-1])
