"""Figures people would rather look at than read: NE over training, reliability curve."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: figures go to files and MLflow, never to a window

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure


def ne_curve(
    steps: Sequence[int],
    window_ne: Sequence[float],
    eval_ne: float | None = None,
    bayes_ne: float | None = None,
    heldout_steps: Sequence[int] = (),
    heldout_ne: Sequence[float] = (),
) -> Figure:
    """Windowed training NE per step and held-out NE during training; the final eval NE and
    the best reachable NE as lines."""
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, window_ne, label="train NE (window)")
    if len(heldout_steps):
        axis.plot(heldout_steps, heldout_ne, marker="o", label="held-out NE (sample)")
    if eval_ne is not None:
        axis.axhline(eval_ne, color="tab:orange", linestyle="--", label=f"eval NE {eval_ne:.4f}")
    if bayes_ne is not None:
        axis.axhline(bayes_ne, color="tab:green", linestyle=":", label=f"Bayes-optimal NE {bayes_ne:.4f}")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    return _finish(figure, axis, "step", "normalized entropy (lower is better)")


def _finish(figure: Figure, axis, xlabel: str, ylabel: str) -> Figure:
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def reliability_bins(labels: np.ndarray, predictions: np.ndarray, bins: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per quantile bin of prediction: mean prediction, observed click rate, count."""
    order = np.argsort(predictions, kind="stable")
    chunks = np.array_split(order, bins)
    mean_prediction = np.array([predictions[c].mean() if len(c) else np.nan for c in chunks])
    click_rate = np.array([labels[c].mean() if len(c) else np.nan for c in chunks])
    counts = np.array([len(c) for c in chunks])
    return mean_prediction, click_rate, counts


def reliability_curve(labels: np.ndarray, predictions: np.ndarray, bins: int = 20) -> Figure:
    """Observed click rate against mean prediction, per quantile bin; the diagonal is calibrated."""
    mean_prediction, click_rate, _ = reliability_bins(labels.astype(np.float64), predictions.astype(np.float64), bins)
    figure, axis = plt.subplots(figsize=(5, 5))
    top = float(np.nanmax([mean_prediction.max(), click_rate.max(), 0.01])) * 1.05
    axis.plot([0, top], [0, top], color="grey", linewidth=0.8, label="calibrated")
    axis.plot(mean_prediction, click_rate, marker="o", label="model")
    axis.set_title(f"Reliability ({bins} quantile bins)")
    return _finish(figure, axis, "mean predicted click probability", "observed click rate")


def relative_ne_curve(history: Sequence[dict], baseline: Sequence[dict]) -> Figure:
    """(NE / baseline NE − 1) in % at equal samples seen: the batch-size accuracy-gap view.

    Both histories hold `samples_seen` and `train_window_ne` per logged step; the baseline
    is interpolated at this run's sample counts, within the range both cover.
    """
    seen = np.array([row["samples_seen"] for row in history], dtype=np.float64)
    ne = np.array([row["train_window_ne"] for row in history], dtype=np.float64)
    base_seen = np.array([row["samples_seen"] for row in baseline], dtype=np.float64)
    base_ne = np.array([row["train_window_ne"] for row in baseline], dtype=np.float64)
    inside = (seen >= base_seen.min()) & (seen <= base_seen.max())
    gap = 100.0 * (ne[inside] / np.interp(seen[inside], base_seen, base_ne) - 1.0)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(seen[inside], gap, label="this run vs the champion's run")
    axis.axhline(0.0, color="grey", linewidth=0.8)
    return _finish(figure, axis, "training samples seen", "NE relative to champion run (%), lower is better")
