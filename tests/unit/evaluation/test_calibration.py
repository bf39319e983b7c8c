"""The calibrators against scikit-learn's fits of the same models, and what they correct."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression

from evaluation.calibration import CalibrationError, Calibrator, fit_calibrator, out_of_fold_gain, served_calibrator


def _miscalibrated(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """True click probabilities, labels drawn from them, and a model that is over-confident
    and under-predicts: σ(1.6 · logit(p) − 0.4)."""
    rng = np.random.default_rng(seed)
    truth = 1.0 / (1.0 + np.exp(-rng.normal(-1.2, 0.8, rows)))
    labels = (rng.random(rows) < truth).astype(np.float64)
    logit = np.log(truth / (1.0 - truth))
    return truth, labels, 1.0 / (1.0 + np.exp(-(1.6 * logit - 0.4)))


def test_platt_matches_scikit_learns_logistic_regression_on_the_logit() -> None:
    _, labels, predictions = _miscalibrated(20_000, seed=0)
    calibrator = fit_calibrator("platt", labels, predictions)
    z = np.log(predictions / (1.0 - predictions)).reshape(-1, 1)
    oracle = LogisticRegression(C=1e12, tol=1e-12, max_iter=10_000).fit(z, labels)
    assert calibrator.slope == pytest.approx(oracle.coef_[0, 0], abs=1e-4)
    assert calibrator.intercept == pytest.approx(oracle.intercept_[0], abs=1e-4)
    assert calibrator.slope == pytest.approx(1 / 1.6, abs=0.03), "it undoes the over-confidence"


def test_platt_brings_the_calibration_of_new_rows_to_one() -> None:
    _, labels, predictions = _miscalibrated(20_000, seed=1)
    calibrator = fit_calibrator("platt", labels, predictions)
    _, new_labels, new_predictions = _miscalibrated(50_000, seed=2)
    before = new_predictions.sum() / new_labels.sum()
    after = calibrator.apply(new_predictions).sum() / new_labels.sum()
    assert before < 0.9 and 0.98 < after < 1.02, (before, after)


def test_isotonic_matches_scikit_learn_without_the_prior_and_never_says_zero_or_one_with_it() -> None:
    _, labels, predictions = _miscalibrated(5_000, seed=3)
    predictions = np.round(predictions, 3)  # ties, pooled first by both
    ours = fit_calibrator("isotonic", labels, predictions, prior_rows=0.0)
    oracle = IsotonicRegression(out_of_bounds="clip").fit(predictions, labels)
    grid = np.concatenate([np.linspace(0.0, 1.0, 2001), predictions[:500]])
    np.testing.assert_allclose(ours.apply(grid), oracle.predict(np.clip(grid, 1e-7, 1 - 1e-7)), atol=1e-12)
    shrunk = fit_calibrator("isotonic", labels, predictions).apply(grid)
    assert shrunk.min() > 0.0 and shrunk.max() < 1.0
    assert np.all(np.diff(shrunk[:2001]) >= -1e-15), "monotone"


def test_a_calibrator_round_trips_and_none_is_the_identity() -> None:
    _, labels, predictions = _miscalibrated(2_000, seed=4)
    for method in ("platt", "isotonic", "none"):
        calibrator = fit_calibrator(method, labels, predictions)
        again = Calibrator.from_dict(calibrator.as_dict())
        assert again == calibrator and again.rows == 2_000
        np.testing.assert_array_equal(again.apply(predictions), calibrator.apply(predictions))
    np.testing.assert_allclose(Calibrator.from_dict(None).apply(predictions), predictions, rtol=1e-12)


def test_rows_of_one_label_or_an_unknown_method_are_refused() -> None:
    with pytest.raises(CalibrationError, match="clicks and non-clicks"):
        fit_calibrator("platt", np.zeros(100), np.full(100, 0.1))
    with pytest.raises(ValueError, match="not one of"):
        fit_calibrator("beta", np.array([0.0, 1.0]), np.array([0.2, 0.3]))


def test_out_of_fold_gain_is_positive_for_a_miscalibrated_model_and_not_for_a_calibrated_one() -> None:
    truth, labels, predictions = _miscalibrated(3_000, seed=5)
    assert out_of_fold_gain("platt", labels, predictions) > 0.005, "it fixes the over-confidence"
    assert out_of_fold_gain("platt", labels, truth) < 0.0005, "nothing to fix in the true probabilities"
    assert out_of_fold_gain("isotonic", labels[:300], truth[:300]) < 0.0, "a step function fits 300 rows' noise"


def test_the_served_calibrator_is_kept_only_where_it_helps_rows_it_was_not_fitted_on() -> None:
    """A model whose probabilities are all twice the click rate: Platt scaling fixes that on
    every fold and is served. A well-calibrated model on few rows: Platt fits their noise,
    lowers no held-out fold's log loss, and the identity is served with the reason."""
    rng = np.random.default_rng(3)
    labels = (rng.random(4000) < 0.2).astype(np.float64)
    overconfident = np.clip(np.where(labels == 1, 0.5, 0.3) + rng.normal(0, 0.05, 4000), 0.01, 0.99)
    served, line = served_calibrator("platt", labels, overconfident)
    assert served.method == "platt" and served.rows == 4000 and "Σ predictions / Σ clicks" in line
    assert abs(np.sum(served.apply(overconfident)) / labels.sum() - 1.0) < 0.02
    few = (rng.random(40) < 0.5).astype(np.float64)
    identity, line = served_calibrator("platt", few, np.full(40, 0.5))
    assert identity.method == "none" and identity.rows == 40
    assert "the model's own probabilities are served" in line and identity.note in line
    off, _ = served_calibrator("none", labels, overconfident)
    assert off.method == "none"
