"""The `pipeline` flow: generate (demo) → ingest → preprocess → train → evaluate → track."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import PipelineConfig, config_as_dict, flatten, load_config
from flows.sources import raw_sources
from flows.tasks import (
    evaluate_task,
    export_task,
    fit_task,
    generate_task,
    ingest_task,
    preprocess_task,
    train_task,
)
from flows.tracking import log_pipeline_run, read_metrics_history


@dataclass(frozen=True)
class PipelineResult:
    config: PipelineConfig
    ingest: list[dict[str, Any]]
    metrics: dict[str, float]
    training: dict[str, Any]
    run_id: str
    experiment_id: str
    model_version: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows_ingested": sum(r["rows_written"] for r in self.ingest),
            "rows_quarantined": sum(r["rows_quarantined"] for r in self.ingest),
            "files_failed": [e for r in self.ingest for e in r["files_failed"]],
            **self.metrics,
            "train_samples_per_s": self.training["samples_per_s"],
            "mlflow_run_id": self.run_id,
            "model_version": self.model_version,
        }


@flow(name="pipeline", log_prints=True)
def pipeline(config_path: str = "configs/demo.toml", overrides: list[str] | None = None) -> dict[str, Any]:
    """The whole slice on one config; returns the summary (also published as an artifact)."""
    return run_stages(load_config(config_path, overrides or [])).as_dict()


def run_stages(config: PipelineConfig) -> PipelineResult:
    logger = get_run_logger()
    started = time.perf_counter()
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    sources = raw_sources(config)
    days = list(config.data.all_days)
    if config.data.source == "synthetic":
        generate_task.map(config, days).result()
    ingest = ingest_task.map(config, days, [sources[d] for d in days]).result()
    _require_ingested(ingest)
    state = fit_task(config)
    feature_files = dict(zip(days, preprocess_task.map(config, state, days).result()))
    training = train_task(config, state, feature_files)
    metrics = evaluate_task(config, state, training["out_dir"])
    model = export_task(config, state, feature_files, training["checkpoint"])
    tracked = _track(config, ingest, metrics, training, model)
    result = PipelineResult(config, ingest, metrics, training, tracked.run_id, tracked.experiment_id, tracked.model_version)
    _publish_summary(result)
    logger.info("pipeline finished in %.0f s; MLflow run %s", time.perf_counter() - started, tracked.run_id)
    return result


def _require_ingested(ingest: list[dict[str, Any]]) -> None:
    empty = [r["day"] for r in ingest if r["rows_written"] == 0 and not r["skipped"]]
    if empty:
        errors = "; ".join(e for r in ingest for e in r["files_failed"]) or "no valid rows"
        raise RuntimeError(f"day(s) {empty} have no ingested rows: {errors}")


def _track(config: PipelineConfig, ingest, metrics, training, model):
    out = Path(training["out_dir"])
    table = pq.read_table(out / "predictions")
    resolved = config_as_dict(config)
    run_metrics = {
        **metrics,
        "rows_ingested": float(sum(r["rows_written"] for r in ingest)),
        "rows_quarantined": float(sum(r["rows_quarantined"] for r in ingest)),
        "train_samples_per_s_overall": training["samples_per_s"],
        "train_steps": float(training["steps"]),
        "train_seconds": training["seconds"],
    }
    return log_pipeline_run(
        tracking_uri=config.tracking_uri,
        artifact_location=config.artifact_location,
        experiment=config.tracking.experiment,
        run_name=f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}",
        params=flatten(resolved),
        config=resolved,
        metrics=run_metrics,
        history=read_metrics_history(out / "metrics.jsonl"),
        artifacts=[out / "plan.txt", out / "plan.json", out / "summary.json"],
        eval_predictions=(table["label"].to_numpy().astype(np.float64), table["prediction"].to_numpy().astype(np.float64)),
        model=model,
        registered_model=config.tracking.registered_model,
        tags={"pipeline.config": config.name, "training.world_size": str(training["world_size"]),
              "training.device": training["device"]},
    )  # fmt: skip


def _publish_summary(result: PipelineResult) -> None:
    summary = result.as_dict()
    rows = "\n".join(
        f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
        for key, value in summary.items()
        if not isinstance(value, list)
    )
    create_markdown_artifact(
        key="pipeline-summary",
        markdown=f"# DLRM pipeline: {result.config.name}\n\n| metric | value |\n|---|---|\n{rows}\n",
        description="Held-out quality, throughput and the MLflow run of this pipeline run",
    )


def run_pipeline(config_path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the flow with as many parallel stage tasks as the config allows."""
    config = load_config(config_path, overrides or [])
    runner = ThreadPoolTaskRunner(max_workers=config.orchestration.max_workers)
    return pipeline.with_options(task_runner=runner)(config_path=config_path, overrides=overrides or [])
