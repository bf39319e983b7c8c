"""The characterization's figures: throughput against the batch with the saturation point,
where a step's time goes, and the planner's estimate against the measured step."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: figures go to files and MLflow

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from training.characterize.measure import MeasuredPoint
from training.loop.profile import PARTS

PART_COLORS = {"data": "tab:gray", "embedding": "tab:blue", "dense": "tab:orange", "communication": "tab:red",
               "optimizer": "tab:green", "other": "lightgray"}  # fmt: skip


def throughput_curve(series: Sequence[tuple[str, list[MeasuredPoint], int | None]]) -> Figure:
    """Samples/s against the global batch (log scale), each window's range as an error bar,
    one line per series, its hardware batch starred."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, points, chosen in series:
        ordered = sorted(points, key=lambda p: p.batch_size)
        if not ordered:
            continue
        batches = [p.batch_size for p in ordered]
        rates = np.array([p.samples_per_s for p in ordered])
        errors = np.array([[p.samples_per_s - p.samples_per_s_min for p in ordered],
                           [p.samples_per_s_max - p.samples_per_s for p in ordered]])  # fmt: skip
        line = axis.errorbar(batches, rates, yerr=errors, marker="o", capsize=3, label=label)
        for point in ordered:
            if point.batch_size == chosen:
                axis.plot([chosen], [point.samples_per_s], marker="*", markersize=16, color=line[0].get_color())
                axis.annotate(f"hardware batch {chosen:,}", (chosen, point.samples_per_s), textcoords="offset points",
                              xytext=(8, -14), fontsize=8)  # fmt: skip
    axis.set_xscale("log", base=2)
    axis.set_ylim(bottom=0)
    axis.set_xlabel("global batch size")
    axis.set_ylabel("samples/s (median of windows; bars: range)")
    axis.set_title("Throughput against the batch size")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def step_breakdown(points: Sequence[tuple[str, MeasuredPoint]]) -> Figure:
    """Stacked bars: each point's step time (ms) by part, from its profiled steps."""
    figure, axis = plt.subplots(figsize=(max(6, 0.7 * len(points) + 2), 4.5))
    labels = [label for label, _ in points]
    bottom = np.zeros(len(points))
    for part in (*PARTS, "other"):
        heights = np.array([point.breakdown_ms.get(part, 0.0) for _, point in points])
        axis.bar(labels, heights, bottom=bottom, label=part, color=PART_COLORS[part])
        bottom += heights
    axis.set_ylabel("ms per step (profiled steps)")
    axis.set_title("Where a step's time goes")
    axis.tick_params(axis="x", labelrotation=60, labelsize=7)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def planner_vs_measured(points: Sequence[tuple[str, MeasuredPoint]]) -> Figure:
    """Per point: the measured step, its embedding and communication part, and the planner's
    estimate (which covers only the embeddings and their communication)."""
    figure, axis = plt.subplots(figsize=(max(6, 0.8 * len(points) + 2), 4.5))
    x = np.arange(len(points))
    width = 0.27
    axis.bar(x - width, [p.measured_step_ms for _, p in points], width, label="measured step")
    axis.bar(x, [p.measured_embedding_ms for _, p in points], width, label="measured embedding + communication")
    axis.bar(x + width, [p.estimated_step_ms for _, p in points], width, label="planner's estimate")
    axis.set_xticks(x, [label for label, _ in points], rotation=60, fontsize=7)
    axis.set_yscale("log")
    axis.set_ylabel("ms per step")
    axis.set_title("The planner's estimate against the measured step")
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure
