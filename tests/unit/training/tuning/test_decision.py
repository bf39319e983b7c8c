"""The paired bootstrap that decides whether tuned values beat the configured ones."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.metrics import binary_state, compute_ne
from training.tuning.decision import paired_gain


def _rows(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = 1.0 / (1.0 + np.exp(-rng.normal(-1.2, 0.9, rows)))
    return (rng.random(rows) < truth).astype(np.float64), truth


def test_the_gain_is_the_ne_difference_and_a_clearly_better_model_wins() -> None:
    labels, truth = _rows(4_000, seed=0)
    blurred = 1.0 / (1.0 + np.exp(-(0.4 * np.log(truth / (1 - truth)) - 0.5)))
    gain = paired_gain(labels, blurred, truth)
    oracle = compute_ne(binary_state(labels, blurred)) - compute_ne(binary_state(labels, truth))
    assert gain.gain == pytest.approx(oracle, rel=1e-9)
    assert gain.real and gain.low > 0 and gain.low < gain.gain < gain.high


def test_noise_alone_is_not_a_gain() -> None:
    labels, truth = _rows(2_000, seed=1)
    rng = np.random.default_rng(2)
    jitter = lambda: np.clip(truth * np.exp(rng.normal(0, 0.05, truth.shape)), 1e-4, 0.999)
    a, b = jitter(), jitter()
    gain = paired_gain(labels, a, b)
    assert not gain.real and gain.low < 0 < gain.high, gain
    same = paired_gain(labels, a, a)
    assert (same.gain, same.low, same.high) == (0.0, 0.0, 0.0) and not same.real
    assert paired_gain(labels, a, b) == gain, "the same rows give the same decision"


def test_unpaired_predictions_are_refused() -> None:
    with pytest.raises(ValueError, match="paired rows"):
        paired_gain(np.zeros(3), np.zeros(3), np.zeros(2))
