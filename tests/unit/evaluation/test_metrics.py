"""Metrics against independent oracles: numpy float64 formulas, scikit-learn, torchrec.metrics."""

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score
from torchrec.metrics import ne as torchrec_ne

from evaluation.metrics import (
    ETA,
    BinaryState,
    MetricError,
    binary_state,
    compute_auc,
    compute_calibration,
    compute_ctr,
    compute_log_loss,
    compute_ne,
    summarize,
)


def _random_case(seed: int, n: int = 5000, weighted: bool = False):
    rng = np.random.default_rng(seed)
    p = rng.beta(0.8, 2.5, n)
    y = (rng.random(n) < p).astype(np.float64)
    w = rng.uniform(0.1, 3.0, n) if weighted else None
    return y, p, w


def _numpy_ne(y, p, w=None) -> float:
    w = np.ones_like(y) if w is None else w
    q = np.clip(p, ETA, 1 - ETA)
    ce = -np.sum(w * (y * np.log2(q) + (1 - y) * np.log2(1 - q)))
    mean = np.clip(np.sum(w * y) / np.sum(w), ETA, 1 - ETA)
    norm = -np.sum(w * y) * np.log2(mean) - np.sum(w * (1 - y)) * np.log2(1 - mean)
    return ce / norm


def _torchrec_ne(y, p, w=None) -> float:
    w = np.ones_like(y) if w is None else w
    states = torchrec_ne.get_ne_states(
        torch.tensor(y[None]), torch.tensor(p[None]), torch.tensor(w[None]), ETA
    )
    value = torchrec_ne.compute_ne(
        states["cross_entropy_sum"], states["weighted_num_samples"], states["pos_labels"], states["neg_labels"], ETA
    )
    return float(value.reshape(-1)[0])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("weighted", [False, True])
def test_ne_matches_numpy_and_torchrec(seed: int, weighted: bool) -> None:
    y, p, w = _random_case(seed, weighted=weighted)
    ne = compute_ne(binary_state(y, p, w))
    assert ne == pytest.approx(_numpy_ne(y, p, w), rel=1e-12)
    assert ne == pytest.approx(_torchrec_ne(y, p, w), rel=1e-10)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("weighted", [False, True])
def test_log_loss_and_auc_match_scikit_learn(seed: int, weighted: bool) -> None:
    y, p, w = _random_case(seed, weighted=weighted)
    assert compute_log_loss(binary_state(y, p, w)) == pytest.approx(sk_log_loss(y, p, sample_weight=w), rel=1e-10)
    assert compute_auc(y, p, w) == pytest.approx(roc_auc_score(y, p, sample_weight=w), rel=1e-12)


def test_auc_counts_ties_as_one_half() -> None:
    rng = np.random.default_rng(1)
    p = rng.integers(0, 5, 2000) / 4.0  # five distinct scores: ties everywhere
    y = (rng.random(2000) < 0.3 + 0.4 * p).astype(float)
    assert compute_auc(y, p) == pytest.approx(roc_auc_score(y, p), rel=1e-12)
    assert compute_auc(np.array([0.0, 1.0]), np.array([0.5, 0.5])) == 0.5


def test_adversarial_predictions_at_the_edges() -> None:
    y = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    p = np.array([0.0, 1.0, 1.0, 0.0, 1e-300, 1 - 1e-17])  # confidently wrong, clamped by eta
    state = binary_state(y, p)
    assert np.isfinite(compute_ne(state))
    assert compute_ne(state) == pytest.approx(_numpy_ne(y, p), rel=1e-12)
    assert compute_ne(state) == pytest.approx(_torchrec_ne(y, p), rel=1e-10)


def test_calibration_and_ctr() -> None:
    y, p, w = _random_case(7, weighted=True)
    state = binary_state(y, p, w)
    assert compute_calibration(state) == pytest.approx(np.sum(w * p) / np.sum(w * y), rel=1e-12)
    assert compute_ctr(state) == pytest.approx(np.sum(w * y) / np.sum(w), rel=1e-12)


def test_streaming_over_chunks_equals_one_pass() -> None:
    y, p, w = _random_case(3, n=10_000, weighted=True)
    whole = binary_state(y, p, w)
    streamed = BinaryState()
    for chunk in np.array_split(np.arange(y.size), 7):
        streamed = streamed + binary_state(y[chunk], p[chunk], w[chunk])
    for a, b in zip(streamed.as_array(), whole.as_array()):
        assert a == pytest.approx(b, rel=1e-12)
    assert compute_ne(streamed) == pytest.approx(compute_ne(whole), rel=1e-12)


def test_predicting_the_click_rate_gives_ne_one() -> None:
    y, _, _ = _random_case(4)
    assert compute_ne(binary_state(y, np.full_like(y, y.mean()))) == pytest.approx(1.0, rel=1e-12)


def test_degenerate_inputs_raise_clear_errors() -> None:
    with pytest.raises(MetricError, match="no examples"):
        compute_ne(binary_state(np.array([]), np.array([])))
    with pytest.raises(MetricError, match="all labels are 0"):
        compute_ne(binary_state(np.zeros(10), np.full(10, 0.2)))
    with pytest.raises(MetricError, match="all labels are 1"):
        compute_ne(binary_state(np.ones(10), np.full(10, 0.2)))
    with pytest.raises(MetricError, match="2 of 4 predictions are NaN or outside"):
        binary_state(np.array([0, 1, 0, 1.0]), np.array([0.1, np.nan, 1.5, 0.3]))
    with pytest.raises(MetricError, match="1 of 3 labels"):
        binary_state(np.array([0, 2.0, 1]), np.array([0.1, 0.2, 0.3]))
    with pytest.raises(MetricError, match="one class"):
        compute_auc(np.ones(5), np.linspace(0, 1, 5))


def test_summary_has_every_metric() -> None:
    y, p, _ = _random_case(2)
    result = summarize(y, p)
    assert set(result) == {"ne", "auc", "calibration", "log_loss", "ctr", "count"}
    assert result["count"] == y.size
