"""MLflow: one run per pipeline run, with config, metrics, plan, plots and the model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import mlflow
import numpy as np
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from evaluation.plots import ne_curve, reliability_curve

log = logging.getLogger(__name__)
MODEL_REQUIREMENTS = ["torch==2.13.0", "torchrec==1.8.0", "fbgemm-gpu-cpu==1.8.0"]


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    experiment_id: str
    model_version: str | None


def read_metrics_history(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def use_experiment(tracking_uri: str, experiment: str, artifact_location: str | None) -> str:
    """Point MLflow at the store and the experiment; a new experiment keeps its artifacts
    at `artifact_location` (the run folder, for the embedded SQLite store)."""
    mlflow.set_tracking_uri(tracking_uri)
    existing = mlflow.get_experiment_by_name(experiment)
    if existing is not None:
        mlflow.set_experiment(experiment_id=existing.experiment_id)
        return existing.experiment_id
    try:
        experiment_id = mlflow.create_experiment(experiment, artifact_location=artifact_location)
    except mlflow.exceptions.MlflowException:
        experiment_id = mlflow.get_experiment_by_name(experiment).experiment_id  # created meanwhile
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def log_pipeline_run(
    tracking_uri: str,
    artifact_location: str | None,
    experiment: str,
    run_name: str,
    params: dict[str, Any],
    config: dict[str, Any],
    metrics: dict[str, float],
    history: list[dict[str, float]],
    artifacts: list[Path],
    eval_predictions: tuple[np.ndarray, np.ndarray] | None,
    model: Any | None,
    registered_model: str | None,
    tags: dict[str, str] | None = None,
) -> TrackedRun:
    """Log everything of one pipeline run; register the model if one is given."""
    experiment_id = use_experiment(tracking_uri, experiment, artifact_location)
    with mlflow.start_run(run_name=run_name, tags=tags or {}) as run:
        mlflow.log_params({k: _param_value(v) for k, v in params.items()})
        mlflow.log_dict(config, "config/resolved_config.json")
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)})
        _log_history(run.info.run_id, history)
        for path in artifacts:
            if path.exists():
                mlflow.log_artifact(str(path), artifact_path="training")
        _log_figures(history, metrics, eval_predictions)
        version = None
        if model is not None:
            info = mlflow.pytorch.log_model(
                model,
                name="model",
                registered_model_name=registered_model,
                pip_requirements=MODEL_REQUIREMENTS,
                # TorchRec's KeyedJaggedTensor input cannot be traced into the pt2 format.
                serialization_format="pickle",
                metadata={"output": "logit; click probability = sigmoid(output)"},
            )
            version = str(info.registered_model_version) if info.registered_model_version else None
    return TrackedRun(run.info.run_id, experiment_id, version)


def _param_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)


def _log_history(run_id: str, history: list[dict[str, float]]) -> None:
    """Per-step training metrics, in batches of at most 1000 (MLflow's limit per call)."""
    client = MlflowClient()
    entries = [
        Metric(f"train_{key}" if not key.startswith("train_") else key, float(value), 0, int(row["step"]))
        for row in history
        for key, value in row.items()
        if key != "step" and value is not None and np.isfinite(value)
    ]
    for start in range(0, len(entries), 1000):
        client.log_batch(run_id, metrics=entries[start : start + 1000])


def _log_figures(
    history: list[dict[str, float]],
    metrics: dict[str, float],
    eval_predictions: tuple[np.ndarray, np.ndarray] | None,
) -> None:
    if history:
        figure = ne_curve(
            [row["step"] for row in history],
            [row["train_window_ne"] for row in history],
            metrics.get("eval_ne"),
            metrics.get("bayes_ne"),
        )
        mlflow.log_figure(figure, "plots/ne_curve.png")
        plt.close(figure)
    if eval_predictions is not None and len(eval_predictions[0]):
        figure = reliability_curve(*eval_predictions)
        mlflow.log_figure(figure, "plots/reliability.png")
        plt.close(figure)
