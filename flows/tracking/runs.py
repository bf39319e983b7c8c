"""MLflow: one run per pipeline run, with config, metrics, plan, plots and the model."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import mlflow
import numpy as np
from mlflow.entities import Metric
from mlflow.models import ModelSignature
from mlflow.models.model import ModelInfo
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, Schema
from mlflow.types.schema import AnyType

from evaluation.plots import ne_curve, relative_ne_curve, reliability_curve
from flows.tracking.sqlite_store import ready
from ingestion.preprocess import PreprocessState
from training.loop.progress import metric_values, read_records
from training.serving.export import CHAMPION_BUNDLED, CHAMPION_CODE, ServingModel

log = logging.getLogger(__name__)


def serving_signature(model: ServingModel) -> ModelSignature:
    """The model's named features, every column optional, and for Criteo data raw lines too.
    The named ones take numbers or text with missing cells (None/NaN), so their type is
    checked by the model."""
    preprocessing = json.loads((model.folder / "model.json").read_text())["preprocessing"]
    names = [*preprocessing.get("dense", [f"I{i}" for i in range(1, 14)]), *preprocessing["buckets"]]
    lines = [] if preprocessing.get("id_types") else [ColSpec("string", "line", required=False)]
    return ModelSignature(inputs=Schema(lines + [ColSpec(AnyType(), name, required=False) for name in names]),
                          outputs=Schema([ColSpec("double")]))  # fmt: skip
LOCAL_UI = "http://127.0.0.1:5000"  # `mlflow ui --port 5000` on a local store


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    experiment_id: str
    model_version: str | None


def run_url(ui: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI at `ui` (e.g. http://127.0.0.1:5000)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def ui_address(tracking_uri: str) -> str:
    """Where the run's MLflow UI is: the tracking server itself, or for a local store the
    address of the `mlflow ui` command that the summary prints."""
    return tracking_uri if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI


@dataclass
class RunRecord:
    """Everything one pipeline run logs."""

    run_name: str
    params: dict[str, Any]
    config: dict[str, Any]
    metrics: dict[str, float]
    history: list[dict[str, float]]
    artifacts: dict[str, list[Path]]  # MLflow artifact folder → local files
    documents: dict[str, Any] = field(default_factory=dict)  # artifact file → JSON-able object
    texts: dict[str, str] = field(default_factory=dict)  # artifact file → text
    eval_predictions: tuple[np.ndarray, np.ndarray] | None = None
    baseline_history: list[dict[str, float]] | None = None  # another run's history, for relative NE
    tags: dict[str, str] = field(default_factory=dict)
    # when the pipeline started (ms since the epoch): the MLflow run's start, so its duration
    # is the pipeline's, not the seconds the logging took
    start_time_ms: int | None = None


def read_metrics_history(path: Path) -> list[dict[str, float]]:
    """The training job's metrics file as rows of values by name (`step` in each), in order."""
    return [metric_values(record) for record in read_records(path)]


def use_experiment(tracking_uri: str, experiment: str, artifact_location: str | None) -> str:
    """Point MLflow at the store and the experiment; a new experiment keeps its artifacts
    at `artifact_location` (the run folder, for the embedded SQLite store)."""
    mlflow.set_tracking_uri(ready(tracking_uri))
    experiment_id = ensure_experiment(tracking_client(tracking_uri), experiment, artifact_location)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


# Run tags that also go on the registered version
VERSION_TAG_PREFIXES = ("lineage.", "preprocessing.")


def log_pipeline_run(
    tracking_uri: str,
    artifact_location: str | None,
    experiment: str,
    record: RunRecord,
    model: ServingModel | None,
    registered_model: str | None,
) -> TrackedRun:
    """Log everything of one pipeline run; register the model if one is given."""
    experiment_id = use_experiment(tracking_uri, experiment, artifact_location)
    created = tracking_client(tracking_uri).create_run(experiment_id, start_time=record.start_time_ms,
                                                       tags=record.tags, run_name=record.run_name)  # fmt: skip
    with mlflow.start_run(run_id=created.info.run_id) as run:
        mlflow.log_params({k: _param_value(v) for k, v in record.params.items()})
        mlflow.log_dict(record.config, "config/resolved_config.json")
        mlflow.log_metrics({k: float(v) for k, v in record.metrics.items() if v is not None and np.isfinite(v)})
        _log_history(run.info.run_id, record.history)
        for folder, paths in record.artifacts.items():
            for path in paths:
                if path.exists():
                    mlflow.log_artifact(str(path), artifact_path=folder)
        for name, document in record.documents.items():
            mlflow.log_dict(document, name)
        for name, text in record.texts.items():
            mlflow.log_text(text, name)
        _log_figures(record)
        version = None
        if model is not None:
            info = log_serving_model(model, registered_model)
            version = str(info.registered_model_version) if info.registered_model_version else None
    if version is not None and registered_model:
        # the registry shows each version's lineage (flows/tracking/lineage.py) without opening its run
        client = tracking_client(tracking_uri)
        for key, value in record.tags.items():
            if key.startswith(VERSION_TAG_PREFIXES):
                client.set_model_version_tag(registered_model, version, key, value)
    return TrackedRun(run.info.run_id, experiment_id, version)


def log_serving_model(model: ServingModel, registered_model: str | None) -> ModelInfo:
    """The pyfunc of training/serving/champion_pyfunc.py, from its code: raw Criteo rows →
    click probabilities, loadable where only its requirements are installed. Its signature
    is given; an input example would only have MLflow score it once more at logging time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*An input example was not provided", category=UserWarning)
        return _log_pyfunc(model, registered_model)


def _log_pyfunc(model: ServingModel, registered_model: str | None) -> ModelInfo:
    return mlflow.pyfunc.log_model(
        name="model",
        python_model=str(CHAMPION_CODE),
        code_paths=[str(path) for path in CHAMPION_BUNDLED],
        artifacts={"model": str(model.folder)},
        pip_requirements=model.requirements,
        signature=serving_signature(model),
        registered_model_name=registered_model,
        metadata={"input": "the features by name (Criteo data: or a column `line` of raw TSV)", "output": "click probability",
                  "serving_device": model.device},
    )


def logged_state(tracking_uri: str, run_id: str) -> PreprocessState:
    """The preprocessing state a pipeline run logged (`preprocessing/state.json`): what its
    model needs to score, or to be continued on, new days."""
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="preprocessing/state.json",
                                               tracking_uri=tracking_uri)  # fmt: skip
    return PreprocessState.load(Path(path))


def logged_state_or_none(tracking_uri: str, run_id: str) -> PreprocessState | None:
    """`logged_state`, or None for a run that logged none."""
    try:
        return logged_state(tracking_uri, run_id)
    except mlflow.exceptions.MlflowException:
        return None


def run_history(tracking_uri: str, run_id: str) -> list[dict[str, float]]:
    """A logged run's training history (samples seen and windowed NE per step)."""
    client = tracking_client(tracking_uri)
    ne = {m.step: m.value for m in client.get_metric_history(run_id, "train_window_ne")}
    seen = {m.step: m.value for m in client.get_metric_history(run_id, "train_samples_seen")}
    return [{"step": s, "samples_seen": seen[s], "train_window_ne": ne[s]} for s in sorted(ne) if s in seen]


def _param_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)


# history keys logged under their own names; any other is a training metric (`train_` + key)
OWN_PREFIXES = ("train_", "heldout_", "validation_")


def _log_history(run_id: str, history: list[dict[str, float]]) -> None:
    """Per-step training metrics, in batches of at most 1000 (MLflow's limit per call)."""
    client = MlflowClient()
    entries = [
        Metric(key if key.startswith(OWN_PREFIXES) else f"train_{key}", float(value), 0, int(row["step"]))
        for row in history
        for key, value in row.items()
        if key != "step" and value is not None and np.isfinite(value)
    ]
    for start in range(0, len(entries), 1000):
        client.log_batch(run_id, metrics=entries[start : start + 1000])


def _log_figures(record: RunRecord) -> None:
    history, metrics = record.history, record.metrics
    figures = []
    train = [row for row in history if "train_window_ne" in row]
    heldout = [row for row in history if "heldout_ne" in row]
    if train:
        figures.append((ne_curve(
            [row["step"] for row in train], [row["train_window_ne"] for row in train],
            metrics.get("eval_ne"), metrics.get("bayes_ne"),
            heldout_steps=[row["step"] for row in heldout], heldout_ne=[row["heldout_ne"] for row in heldout],
        ), "plots/ne_curve.png"))  # fmt: skip
    if record.eval_predictions is not None and len(record.eval_predictions[0]):
        figures.append((reliability_curve(*record.eval_predictions), "plots/reliability.png"))
    if train and record.baseline_history:
        figures.append((relative_ne_curve(train, record.baseline_history), "plots/ne_relative_to_champion.png"))
    for figure, name in figures:
        mlflow.log_figure(figure, name)
        plt.close(figure)


def ensure_experiment(client: MlflowClient, experiment: str, artifact_location: str | None) -> str:
    """The experiment's id, creating it (with its artifact location) if it is new."""
    existing = client.get_experiment_by_name(experiment)
    if existing is not None:
        return existing.experiment_id
    try:
        return client.create_experiment(experiment, artifact_location=artifact_location)
    except mlflow.exceptions.MlflowException:
        return client.get_experiment_by_name(experiment).experiment_id  # created meanwhile


def log_study_plots(client: MlflowClient, run_id: str, study) -> None:
    """Optimisation history and parameter importances of an Optuna study, as PNGs."""
    from optuna.visualization import matplotlib as optuna_plots

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    plots = [("plots/optimization_history.png", optuna_plots.plot_optimization_history)]
    if len(complete) >= 2:  # importances need a spread of finished trials
        plots.append(("plots/param_importances.png", optuna_plots.plot_param_importances))
    for name, plot in plots:
        try:
            axes = plot(study)
        except (ValueError, RuntimeError) as error:
            log.warning("study plot %s skipped: %s", name, error)
            continue
        figure = axes.figure if hasattr(axes, "figure") else axes[0].figure
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        client.log_figure(run_id, figure, name)
        plt.close(figure)


def tracking_client(tracking_uri: str) -> MlflowClient:
    """A client of the tracking server (or store) at `tracking_uri` (a new SQLite store made
    from the migrated template: flows/tracking/sqlite_store.py)."""
    return MlflowClient(tracking_uri=ready(tracking_uri))


def newest_run_of_key(tracking_uri: str, experiment: str, fingerprint: str) -> tuple[float, float] | None:
    """The held-out NE and training seconds of the newest finished run of a tuning key (None:
    no such run): what the port workflow compares a ported run with."""
    client = tracking_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], f"tags.`tuning.key` = '{fingerprint}' and "
                              "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])  # fmt: skip
    for run in runs:
        metrics = run.data.metrics
        if "heldout_ne" in metrics and "train_seconds" in metrics:
            return metrics["heldout_ne"], metrics["train_seconds"]
    return None
