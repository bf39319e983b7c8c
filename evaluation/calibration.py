"""A calibrator: the model's click probabilities mapped so that they mean what they say.

Fitted on the model's predictions of rows it never trained on and that are not the
evaluation days (a hashed share of the training rows, ingestion/holdout.py), applied to
every prediction the run reports and the registered model serves.

- `platt`: p' = σ(a · logit(p) + b), a logistic regression on the model's own logit (two
  numbers: a rescales confidence, b moves the base rate);
- `isotonic`: the monotone step function of p that best fits the labels (pool adjacent
  violators), interpolated linearly between its steps; each step's rate is shrunk by one
  pseudo-row at the overall rate, so no step says 0 or 1 outright;
- `none`: the model's probabilities as they are.

numpy and the standard library only: the registered model bundles this file and applies the
same calibrator to the probabilities it serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("platt", "isotonic", "none")
_EPS = 1e-7  # probabilities are kept in [ε, 1 − ε] before their logit is taken


class CalibrationError(ValueError):
    """The rows cannot fit a calibrator (none, or a single label)."""


@dataclass(frozen=True)
class Calibrator:
    method: str = "none"
    slope: float = 1.0  # platt: a
    intercept: float = 0.0  # platt: b
    points: tuple[float, ...] = ()  # isotonic: probabilities, ascending
    values: tuple[float, ...] = ()  # isotonic: the calibrated probability at each point
    rows: int = 0  # the rows it was fitted on
    note: str = ""  # why a "none" calibrator was kept where one was asked for

    def apply(self, predictions: np.ndarray) -> np.ndarray:
        """The calibrated probabilities of `predictions` (float64)."""
        if self.method == "none":
            return np.asarray(predictions, dtype=np.float64)
        p = np.clip(np.asarray(predictions, dtype=np.float64), _EPS, 1.0 - _EPS)
        if self.method == "platt":
            return 1.0 / (1.0 + np.exp(-(self.slope * np.log(p / (1.0 - p)) + self.intercept)))
        if self.method == "isotonic":
            return np.interp(p, np.asarray(self.points), np.asarray(self.values))
        return _unknown(self.method)

    def describe(self) -> str:
        if self.method == "platt":
            return f"Platt scaling (σ({self.slope:.4f} · logit + {self.intercept:+.4f})), fitted on {self.rows:,} rows"
        if self.method == "isotonic":
            return f"isotonic regression ({len(self.points)} points), fitted on {self.rows:,} rows"
        return f"none ({self.note})" if self.note else "none"

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "slope": self.slope, "intercept": self.intercept,
                "points": list(self.points), "values": list(self.values), "rows": self.rows, "note": self.note}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Calibrator:
        """A calibrator as `as_dict` wrote it; nothing written (a model logged before
        calibration existed): the identity."""
        if not data:
            return cls()
        if data.get("method") not in METHODS:
            _unknown(data.get("method"))
        return cls(data["method"], float(data.get("slope", 1.0)), float(data.get("intercept", 0.0)),
                   tuple(map(float, data.get("points", ()))), tuple(map(float, data.get("values", ()))),
                   int(data.get("rows", 0)), str(data.get("note", "")))  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.as_dict())


def fit_calibrator(method: str, labels: np.ndarray, predictions: np.ndarray, prior_rows: float = 1.0) -> Calibrator:
    """The `method` calibrator of `predictions` against 0/1 `labels`. `prior_rows`: the
    pseudo-rows at the overall rate each isotonic step is shrunk with."""
    if method not in METHODS:
        _unknown(method)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(predictions, dtype=np.float64).reshape(-1), _EPS, 1.0 - _EPS)
    if method == "none":
        return Calibrator(rows=len(y))
    if len(y) == 0 or y.min() == y.max():
        raise CalibrationError(f"{len(y):,} rows with {'no' if len(y) == 0 else 'a single'} label value: "
                               "a calibrator needs clicks and non-clicks")  # fmt: skip
    if method == "platt":
        slope, intercept = _platt(np.log(p / (1.0 - p)), y)
        return Calibrator("platt", slope, intercept, rows=len(y))
    points, values = _isotonic(p, y, prior_rows)
    return Calibrator("isotonic", points=points, values=values, rows=len(y))


def out_of_fold_gain(method: str, labels: np.ndarray, predictions: np.ndarray, folds: int = 5) -> float:
    """How much the `method` calibrator lowers the mean log loss of rows it was not fitted on:
    each of `folds` folds (a fixed shuffle) scored by a calibrator fitted on the others,
    against the model's own probabilities on the same rows. Positive: it helps."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(predictions, dtype=np.float64).reshape(-1), _EPS, 1.0 - _EPS)
    fold = np.random.default_rng(0).permutation(len(y)) % folds
    own, calibrated = 0.0, 0.0
    for k in range(folds):
        test, train = fold == k, fold != k
        try:
            fitted = fit_calibrator(method, y[train], p[train]).apply(p[test])
        except CalibrationError:
            return 0.0  # a fold of one label: too few rows to tell
        own += float(row_log_loss(y[test], p[test]).sum())
        calibrated += float(row_log_loss(y[test], fitted).sum())
    return (own - calibrated) / len(y)


def row_log_loss(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """Each row's log loss (float64), its probability kept in [ε, 1 − ε]."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(predictions, dtype=np.float64).reshape(-1), _EPS, 1.0 - _EPS)
    return -(y * np.log(p) + (1.0 - y) * np.log(1.0 - p))


def _platt(z: np.ndarray, y: np.ndarray, ridge: float = 1e-6, iterations: int = 100) -> tuple[float, float]:
    """Newton's method on the log loss of σ(a z + b); a tiny ridge keeps separable rows finite."""
    a, b = 1.0, 0.0
    design = np.stack([z, np.ones_like(z)], axis=1)
    n = len(y)
    for _ in range(iterations):
        q = 1.0 / (1.0 + np.exp(-(a * z + b)))
        gradient = design.T @ (q - y) / n + ridge * np.array([a - 1.0, b])
        weights = q * (1.0 - q)
        hessian = (design * weights[:, None]).T @ design / n + ridge * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        a, b = a - float(step[0]), b - float(step[1])
        if np.abs(step).max() < 1e-12:
            break
    return a, b


def _isotonic(p: np.ndarray, y: np.ndarray, prior_rows: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Pool adjacent violators over the rows sorted by p (equal p pooled first); each block
    keeps its lowest and highest p as the points of its level."""
    order = np.argsort(p, kind="stable")
    p, y = p[order], y[order]
    unique, start = np.unique(p, return_index=True)
    sums, counts = np.add.reduceat(y, start), np.diff(np.append(start, len(p))).astype(np.float64)
    # blocks as a stack: [level sum, count, lowest p, highest p]
    blocks: list[list[float]] = []
    for value, total, count in zip(unique, sums, counts):
        blocks.append([total, count, value, value])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            total_, count_, _, high = blocks.pop()
            blocks[-1][0] += total_
            blocks[-1][1] += count_
            blocks[-1][3] = high
    rate = float(y.mean())
    points, values = [], []
    for total, count, low, high in blocks:
        level = (total + prior_rows * rate) / (count + prior_rows)
        points.append(low)
        values.append(level)
        if high > low:
            points.append(high)
            values.append(level)
    return tuple(points), tuple(values)


def _unknown(method: Any) -> Any:
    raise ValueError(f"calibration: {method!r} is not one of {list(METHODS)}")


def served_calibrator(method: str, labels: np.ndarray, predictions: np.ndarray) -> tuple[Calibrator, str]:
    """The calibrator to serve for a model whose held-out rows scored `predictions`, and a
    line saying why: the `method` calibrator when it fits and also lowers the log loss of
    rows it was not fitted on (on few rows a calibrator can fit their noise: 5 folds of the
    held-out rows); otherwise the identity, with the reason as its note."""
    rows = len(labels)
    if method == "none":
        return Calibrator(rows=rows, note="evaluation.calibration = \"none\""), "off"
    try:
        calibrator = fit_calibrator(method, labels, predictions)
    except CalibrationError as error:
        return Calibrator(rows=rows, note=str(error)), f"not fitted ({error}); the model's own probabilities are served"
    gain = out_of_fold_gain(method, labels, predictions)
    if gain <= 0.0:
        note = (f"{calibrator.describe()} did not lower the log loss of held-out rows it was not fitted on "
                f"({gain:+.2e} a row over 5 folds): the model's own probabilities are served")  # fmt: skip
        return Calibrator(rows=rows, note=note), note
    clicks = max(float(np.sum(labels)), 1.0)
    before, after = float(np.sum(predictions)) / clicks, float(np.sum(calibrator.apply(predictions))) / clicks
    return calibrator, f"{calibrator.describe()}; on those rows Σ predictions / Σ clicks {before:.3f} → {after:.3f}"
