"""Binary-classification quality metrics as pure functions over summed states.

NE follows TorchRec's definition (`torchrec/metrics/ne.py`): the summed cross entropy of
the predictions, clamped to [η, 1 − η] with η = 1e-12, divided by the cross entropy of
predicting the (clamped) mean label for every example; float64 throughout, optional
per-example weights. 1.0 means "no better than the click rate"; lower is better.

A `BinaryState` holds sums only, so states of chunks or of ranks add up to the state of
the whole: streaming and all-reduce give exactly the one-pass answer. AUC needs the
predictions themselves and is computed exactly, with ties counted as one half.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

ETA = 1e-12


class MetricError(ValueError):
    """The input cannot be scored: no examples, invalid predictions, or a degenerate label set."""


@dataclass(frozen=True)
class BinaryState:
    """Weighted sums over examples; natural-log cross entropy."""

    count: float = 0.0  # Σ w
    label_sum: float = 0.0  # Σ w·y
    prediction_sum: float = 0.0  # Σ w·p
    cross_entropy_sum: float = 0.0  # Σ w·(−y ln p − (1 − y) ln(1 − p)), p clamped

    def __add__(self, other: BinaryState) -> BinaryState:
        return BinaryState(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_array(self) -> np.ndarray:
        """The sums as a float64 vector, e.g. for an all-reduce."""
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)

    @classmethod
    def from_array(cls, values: np.ndarray) -> BinaryState:
        return cls(*(float(v) for v in values))


def check_inputs(labels: np.ndarray, predictions: np.ndarray, weights: np.ndarray | None = None) -> None:
    """Raise `MetricError` naming how many values are wrong, if any are."""
    if labels.shape != predictions.shape or (weights is not None and weights.shape != labels.shape):
        raise MetricError(f"labels, predictions (and weights) differ in shape: {labels.shape} vs {predictions.shape}")
    bad_predictions = int(np.count_nonzero(~((predictions >= 0) & (predictions <= 1))))  # NaN fails both
    if bad_predictions:
        raise MetricError(f"{bad_predictions} of {predictions.size} predictions are NaN or outside [0, 1]")
    bad_labels = int(np.count_nonzero(~((labels >= 0) & (labels <= 1))))
    if bad_labels:
        raise MetricError(f"{bad_labels} of {labels.size} labels are NaN or outside [0, 1]")
    if weights is not None:
        bad_weights = int(np.count_nonzero(~(weights >= 0)))
        if bad_weights:
            raise MetricError(f"{bad_weights} of {weights.size} weights are NaN or negative")


def binary_state(labels: np.ndarray, predictions: np.ndarray, weights: np.ndarray | None = None) -> BinaryState:
    """The summed state of one chunk of examples."""
    y = np.asarray(labels, dtype=np.float64)
    p = np.asarray(predictions, dtype=np.float64)
    w = None if weights is None else np.asarray(weights, dtype=np.float64)
    check_inputs(y, p, w)
    clamped = np.clip(p, ETA, 1.0 - ETA)
    cross_entropy = -(y * np.log(clamped) + (1.0 - y) * np.log1p(-clamped))
    if w is None:
        return BinaryState(float(y.size), float(y.sum()), float(p.sum()), float(cross_entropy.sum()))
    return BinaryState(float(w.sum()), float(w @ y), float(w @ p), float(w @ cross_entropy))


def _require_examples(state: BinaryState) -> None:
    if state.count <= 0:
        raise MetricError("no examples to score (the total weight is 0)")


def compute_ne(state: BinaryState) -> float:
    """Normalized entropy. Undefined when all labels are equal: that raises `MetricError`."""
    _require_examples(state)
    negatives = state.count - state.label_sum
    if state.label_sum <= 0 or negatives <= 0:
        kind = "0" if state.label_sum <= 0 else "1"
        raise MetricError(
            f"NE is undefined: all labels are {kind}, so the click rate's entropy is 0"
        )
    mean_label = min(max(state.label_sum / state.count, ETA), 1.0 - ETA)
    norm = -state.label_sum * np.log(mean_label) - negatives * np.log1p(-mean_label)
    return float(state.cross_entropy_sum / norm)


def compute_log_loss(state: BinaryState) -> float:
    """Mean cross entropy in nats."""
    _require_examples(state)
    return state.cross_entropy_sum / state.count


def compute_calibration(state: BinaryState) -> float:
    """Σ predictions / Σ labels: 1.0 is calibrated, above 1 over-predicts clicks."""
    _require_examples(state)
    if state.label_sum <= 0:
        raise MetricError("calibration is undefined: there are no positive labels")
    return state.prediction_sum / state.label_sum


def compute_ctr(state: BinaryState) -> float:
    _require_examples(state)
    return state.label_sum / state.count


def compute_auc(labels: np.ndarray, predictions: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Exact ROC AUC: P(score of a positive > score of a negative), ties counting one half."""
    y = np.asarray(labels, dtype=np.float64)
    p = np.asarray(predictions, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    check_inputs(y, p, w)
    if y.size == 0:
        raise MetricError("no examples to score")
    # One group per distinct score; positive and negative weight within each group.
    unique_scores, group = np.unique(p, return_inverse=True)
    positive = np.bincount(group, weights=w * y, minlength=unique_scores.size)
    negative = np.bincount(group, weights=w * (1.0 - y), minlength=unique_scores.size)
    total_positive, total_negative = positive.sum(), negative.sum()
    if total_positive <= 0 or total_negative <= 0:
        raise MetricError("AUC is undefined: the labels are all of one class")
    negatives_below = np.cumsum(negative) - negative
    wins = positive @ (negatives_below + 0.5 * negative)
    return float(wins / (total_positive * total_negative))


def summarize(labels: np.ndarray, predictions: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """Every metric for one set of examples: ne, auc, calibration, log_loss, ctr, count."""
    state = binary_state(labels, predictions, weights)
    return {
        "ne": compute_ne(state),
        "auc": compute_auc(labels, predictions, weights),
        "calibration": compute_calibration(state),
        "log_loss": compute_log_loss(state),
        "ctr": compute_ctr(state),
        "count": state.count,
    }
