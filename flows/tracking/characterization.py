"""A characterization in MLflow: one run with the plots, the points' table and the hardware's
batch tagged beside the tuning key's hardware fields (what `dlrm port` looks up)."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import mlflow

from flows.run.config import PipelineConfig
from flows.tracking.runs import tracking_client, use_experiment
from training.characterize.plots import planner_vs_measured, step_breakdown, throughput_curve
from training.tuning.key import TuningKey

if TYPE_CHECKING:
    from flows.characterize.measure import SeriesResult
    from flows.run.reports import CharacterizeReport

KIND_TAG = "dlrm.kind"
KIND = "characterize"
HARDWARE_BATCH_TAG = "characterize.hardware_batch_size"
HARDWARE_TAG = "characterize.hardware"  # device type | model | memory GB | world size | hosts


def hardware_tag(key: TuningKey) -> str:
    """The hardware a characterization measured, as one tag value to search by."""
    return f"{key.device_type}|{key.device_model}|{key.memory_per_device_gb}|{key.world_size}|{key.hosts}"


def log_characterization(config: PipelineConfig, report: CharacterizeReport, results: list[SeriesResult],
                         key: TuningKey) -> str:  # fmt: skip
    """Log the run; returns its id."""
    experiment_id = use_experiment(config.tracking_uri, config.tracking.experiment, config.artifact_location)
    tags = {KIND_TAG: KIND, HARDWARE_TAG: hardware_tag(key), **key.as_tags(),
            HARDWARE_BATCH_TAG: str(report.hardware_batch_size or "")}  # fmt: skip
    created = tracking_client(config.tracking_uri).create_run(experiment_id, tags=tags,
                                                              run_name=f"characterize {report.device}")  # fmt: skip
    labelled = [(f"{r.label} · {p.batch_size:,}" if len(results) > 1 else f"{p.batch_size:,}", p)
                for r in results for p in r.points]  # fmt: skip
    with mlflow.start_run(run_id=created.info.run_id) as run:
        mlflow.log_params({"config": report.config, "device": report.device, "min_gain": report.min_gain,
                           "series": len(results), "points": len(report.points)})  # fmt: skip
        if report.hardware_batch_size is not None:
            mlflow.log_metric("hardware_batch_size", report.hardware_batch_size)
        for index, result in enumerate(results):
            for point in sorted(result.points, key=lambda p: p.batch_size):
                mlflow.log_metric(f"samples_per_s.series_{index}", point.samples_per_s, step=point.batch_size)
        _log_figure(throughput_curve([(r.label, r.points, r.hardware_batch_size) for r in results]),
                    "characterize/throughput_vs_batch.png")  # fmt: skip
        if labelled:
            _log_figure(step_breakdown(labelled), "characterize/step_breakdown.png")
            _log_figure(planner_vs_measured(labelled), "characterize/planner_vs_measured.png")
        mlflow.log_table(_columns(report.points), "characterize/points.json")
        mlflow.log_text(_csv(report.points), "characterize/points.csv")
        mlflow.log_dict({"series": report.series, "skipped": report.skipped, "tuning_key": asdict(key)},
                        "characterize/summary.json")  # fmt: skip
    return run.info.run_id


def _log_figure(figure, name: str) -> None:
    mlflow.log_figure(figure, name)
    plt.close(figure)


def _flat(point: dict) -> dict:
    flat = {k: v for k, v in point.items() if k not in ("breakdown_ms", "peak_memory_mb_per_rank")}
    flat.update({f"{part}_ms": value for part, value in point["breakdown_ms"].items()})
    return flat


def _columns(points: list[dict]) -> dict[str, list]:
    rows = [_flat(p) for p in points]
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}


def _csv(points: list[dict]) -> str:
    rows = [_flat(p) for p in points]
    names = list(dict.fromkeys(name for row in rows for name in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=names)
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
