"""The evaluation report: metrics per held-out day and overall, slices, and reference NEs.

Pure functions over arrays; the flow feeds them predictions and logs what they return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from evaluation.metrics import BinaryState, MetricError, binary_state, compute_ne, summarize


@dataclass(frozen=True)
class Scores:
    """One set of examples: labels, predictions, and the slice value of each row."""

    labels: np.ndarray
    predictions: np.ndarray
    slices: np.ndarray | None = None

    @staticmethod
    def concat(parts: list[Scores]) -> Scores:
        slices = None if any(p.slices is None for p in parts) else np.concatenate([p.slices for p in parts])
        return Scores(np.concatenate([p.labels for p in parts]), np.concatenate([p.predictions for p in parts]), slices)


@dataclass(frozen=True)
class EvalReport:
    overall: dict[str, float]
    per_day: dict[int, dict[str, float]]
    # top-k slice values: value, count, ne, ctr, calibration (and, when the model's
    # probabilities were calibrated, ne_uncalibrated and calibration_uncalibrated)
    slices: list[dict[str, float]]
    references: dict[str, float] = field(default_factory=dict)  # name → NE on the same days
    # The model's own probabilities before calibration, overall (empty: not calibrated).
    uncalibrated: dict[str, float] = field(default_factory=dict)

    def flat_metrics(self) -> dict[str, float]:
        """MLflow-style names: eval_ne, eval_ne_day_2, eval_ne_slice_rank_1, lr_ne,
        eval_ne_uncalibrated, ..."""
        flat = {f"eval_{k}": v for k, v in self.overall.items()}
        for day, metrics in self.per_day.items():
            flat.update({f"eval_{k}_day_{day}": v for k, v in metrics.items()})
        for rank, row in enumerate(self.slices, start=1):
            flat[f"eval_ne_slice_rank_{rank}"] = row["ne"]
        flat.update({f"eval_{k}_uncalibrated": v for k, v in self.uncalibrated.items() if k in _BEFORE})
        flat.update(self.references)
        return flat


_BEFORE = ("ne", "calibration", "auc", "log_loss")  # what the report keeps of the uncalibrated model


def build_report(
    scores_by_day: Mapping[int, Scores],
    slice_top_k: int = 5,
    reference_scores: Mapping[str, Mapping[int, Scores]] | None = None,
    reference_states: Mapping[str, BinaryState] | None = None,
    uncalibrated: Mapping[int, Scores] | None = None,
) -> EvalReport:
    """Metrics of the model per day and overall; the NE of reference predictors on the same days.

    `reference_scores`: other predictors' scores by day (e.g. logistic regression);
    `reference_states`: references known only by their summed state (e.g. Bayes-optimal).
    Each reference adds `<name>_ne` and `ne_gain_vs_<name>_pct` (positive: the model is better).
    `uncalibrated`: the same rows' scores before calibration (`scores_by_day` are after),
    reported beside them overall and per slice.
    """
    days = sorted(scores_by_day)
    everything = Scores.concat([scores_by_day[d] for d in days])
    overall = summarize(everything.labels, everything.predictions)
    before: dict[str, float] = {}
    slices = top_slices(everything, slice_top_k)
    if uncalibrated is not None:
        raw = Scores.concat([uncalibrated[d] for d in days])
        before = {k: v for k, v in summarize(raw.labels, raw.predictions).items() if k in _BEFORE}
        slices = _with_uncalibrated(slices, raw)
    per_day = {day: summarize(scores_by_day[day].labels, scores_by_day[day].predictions) for day in days}
    references: dict[str, float] = {}
    for name, by_day in (reference_scores or {}).items():
        joined = Scores.concat([by_day[d] for d in days])
        references[f"{name}_ne"] = compute_ne(binary_state(joined.labels, joined.predictions))
    for name, state in (reference_states or {}).items():
        references[f"{name}_ne"] = compute_ne(state)
    for name in list(references):
        base = name[: -len("_ne")]
        references[f"ne_gain_vs_{base}_pct"] = 100.0 * (references[name] - overall["ne"]) / references[name]
    return EvalReport(overall, per_day, slices, references, before)


def top_slices(scores: Scores, k: int) -> list[dict[str, float]]:
    """NE on each of the k most frequent slice values (skipping values with one label only)."""
    if scores.slices is None:
        return []
    values, counts = np.unique(scores.slices, return_counts=True)
    rows = []
    for index in np.argsort(-counts, kind="stable"):
        mask = scores.slices == values[index]
        try:
            ne = compute_ne(binary_state(scores.labels[mask], scores.predictions[mask]))
        except MetricError:
            continue  # a slice with only clicks or only non-clicks has no NE
        rows.append({"value": float(values[index]), "count": float(counts[index]), "ne": ne,
                     "ctr": float(scores.labels[mask].mean()),
                     "calibration": float(scores.predictions[mask].sum() / scores.labels[mask].sum())})  # fmt: skip
        if len(rows) == k:
            break
    return rows


def _with_uncalibrated(rows: list[dict[str, float]], raw: Scores) -> list[dict[str, float]]:
    """Each slice row with the uncalibrated model's NE and calibration on the same rows."""
    assert raw.slices is not None or not rows
    out = []
    for row in rows:
        mask = raw.slices == row["value"]
        labels, predictions = raw.labels[mask], raw.predictions[mask]
        out.append({**row, "ne_uncalibrated": compute_ne(binary_state(labels, predictions)),
                    "calibration_uncalibrated": float(predictions.sum() / labels.sum())})  # fmt: skip
    return out


def report_markdown(report: EvalReport, title: str, champion_ne: float | None = None) -> str:
    """The report as Markdown tables, for a Prefect artifact."""
    lines = [f"# {title}", "", "| days | examples | NE | AUC | calibration | log loss |", "|---|---|---|---|---|---|"]
    for day, m in report.per_day.items():
        lines.append(_row(str(day), m))
    lines.append(_row("**all**", report.overall))
    if report.uncalibrated:
        lines.append(f"| all, before calibration | | {report.uncalibrated['ne']:.4f} | {report.uncalibrated['auc']:.4f} | "
                     f"{report.uncalibrated['calibration']:.3f} | {report.uncalibrated['log_loss']:.4f} |")  # fmt: skip
    lines += ["", "| reference | NE on the same days | model's gain |", "|---|---|---|"]
    for name, value in report.references.items():
        if name.endswith("_ne"):
            gain = report.references.get(f"ne_gain_vs_{name[:-3]}_pct")
            lines.append(f"| {name[:-3]} | {value:.4f} | {gain:+.2f} % |")
    if champion_ne is not None:
        gain = 100.0 * (champion_ne - report.overall["ne"]) / champion_ne
        lines.append(f"| current champion | {champion_ne:.4f} | {gain:+.2f} % |")
    if report.slices and report.uncalibrated:
        lines += ["", "| slice value | examples | CTR | NE | calibration | NE before calibration | calibration before |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {int(s['value'])} | {int(s['count']):,} | {s['ctr']:.3f} | {s['ne']:.4f} | {s['calibration']:.3f} | "
                  f"{s['ne_uncalibrated']:.4f} | {s['calibration_uncalibrated']:.3f} |" for s in report.slices]  # fmt: skip
    elif report.slices:
        lines += ["", "| slice value | examples | CTR | NE | calibration |", "|---|---|---|---|---|"]
        lines += [f"| {int(s['value'])} | {int(s['count']):,} | {s['ctr']:.3f} | {s['ne']:.4f} | {s['calibration']:.3f} |"
                  for s in report.slices]  # fmt: skip
    return "\n".join(lines) + "\n"


def _row(label: str, m: Mapping[str, float]) -> str:
    return (f"| {label} | {int(m['count']):,} | {m['ne']:.4f} | {m['auc']:.4f} | "
            f"{m['calibration']:.3f} | {m['log_loss']:.4f} |")  # fmt: skip
