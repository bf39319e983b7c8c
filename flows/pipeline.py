"""The `pipeline` flow: generate (demo) → ingest → preprocess → train → evaluate → track → promote."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from evaluation.promotion import PromotionDecision
from evaluation.report import EvalReport, Scores, report_markdown
from flows.config import PipelineConfig, config_as_dict, flatten, load_config, load_flow_config
from flows.deferred import track_or_defer, wait_for_tracking
from flows.features import prepare_features, with_run_length
from flows.recurring import (
    Night,
    keep_checkpoint,
    lineage_tags,
    night_config,
    plan_night,
    prune_lineage,
    resolve_as_of,
    skipped_summary,
    with_champion_shape,
)
from flows.registry import current_champion
from flows.stopped_runs import cancel_when_stopped
from flows.tasks import (
    TrainedModel,
    baseline_task,
    evaluate_task,
    export_task,
    promote_task,
    train_task,
)
from flows.tracking import (
    RunRecord,
    TrackedRun,
    read_metrics_history,
    run_history,
    run_url,
    ui_address,
)
from flows.tuning import choose_hyperparameters, with_params
from ingestion.preprocess import PreprocessState
from training.tuning.trigger import TuningDecision


@dataclass(frozen=True)
class PipelineResult:
    config: PipelineConfig
    ingest: list[dict[str, Any]]
    report: EvalReport
    training: TrainedModel
    tracked: TrackedRun
    decision: PromotionDecision | None
    tuning: TuningDecision
    night: Night

    def as_dict(self) -> dict[str, Any]:
        data = self.config.data  # days as the config writes them (dates, or integers)
        return {
            "as_of": None if self.night.as_of is None else data.shown(self.night.as_of),
            "eval_days": data.shown_days(data.eval_days),
            "skipped": False,
            "days_trained": data.shown_days(data.train_days),
            "lineage_days": data.shown_days(self.night.lineage_days),
            "warm_start_version": self.night.warm_start.version if self.night.warm_start else None,
            "rows_ingested": sum(r["rows_written"] for r in self.ingest),
            "rows_quarantined": sum(r["rows_quarantined"] for r in self.ingest),
            "files_failed": [e for r in self.ingest for e in r["files_failed"]],
            "days_already_ingested": [r["day"] for r in self.ingest if r["skipped"]],
            **self.report.flat_metrics(),
            "train_samples_per_s": self.training.summary.samples_per_s,
            "samples_per_s": self.training.summary.samples_per_s,  # the key `dlrm train --json` reports it by
            "rows_trained": self.training.summary.rows_trained,
            "resumed_from_step": self.training.summary.resumed_from_step,
            "steps": self.training.summary.steps,
            "world_size": self.training.summary.world_size,
            "global_batch_size": self.config.training.batch_size,
            "mlflow_run_id": self.tracked.run_id,
            "mlflow_run_url": run_url(ui_address(self.config.tracking_uri), self.tracked.experiment_id,
                                      self.tracked.run_id) if self.tracked.experiment_id else None,
            "model_version": self.tracked.model_version,
            "promoted": bool(self.decision and self.decision.promote),
            "promotion_reason": self.decision.reason if self.decision else "no model registered",
            "champion_ne_same_days": self.decision.champion_ne if self.decision else None,
            "tuning_key": self.tuning.key.fingerprint,
            "tuning_decision": self.tuning.action,
            "tuning_reason": self.tuning.reason,
        }


@flow(name="pipeline", log_prints=True, on_crashed=[cancel_when_stopped])
def pipeline(config_path: str = "configs/demo.toml", overrides: list[str] | None = None,
             as_of: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole slice on one config; returns the summary (also published as artifacts).
    `as_of`: a day, or "newest" (the newest complete one): continue the champion on the
    days before it that it has not seen and judge on that day (flows/recurring.py)."""
    overrides = overrides or []
    return run_stages(load_flow_config(config_path, overrides), config_path, overrides, as_of).as_dict()


@flow(name="retrain", log_prints=True, on_crashed=[cancel_when_stopped])
def retrain(
    config_path: str = "configs/demo.toml",
    batch_size: int | None = None,
    train_days: list[int] | None = None,
    eval_days: list[int] | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """The pipeline on demand (the dashboard's Run button), with the usual knobs as fields."""
    extra = [f"training.batch_size={batch_size}"] if batch_size else []
    extra += [f"data.train_days={list(train_days)}"] if train_days else []
    extra += [f"data.eval_days={list(eval_days)}"] if eval_days else []
    overrides = [*(overrides or []), *extra]
    return run_stages(load_flow_config(config_path, overrides), config_path, overrides).as_dict()


def run_stages(config: PipelineConfig, config_path: str, overrides: list[str],
               as_of: str | int | None = None) -> PipelineResult | SkippedNight:  # fmt: skip
    logger = get_run_logger()
    started, started_at_ms = time.perf_counter(), int(time.time() * 1000)
    night, config = _plan(config, as_of)
    if night.skipped:
        logger.info("as of day %s: %s", config.data.shown(night.as_of), night.skipped)
        return SkippedNight(skipped_summary(night, MlflowClient(tracking_uri=config.tracking_uri), config))
    warm = night.warm_start
    features = prepare_features(config, warm.state if warm else None)
    ingest, state, feature_files = features.ingest, features.state, features.files
    config = with_run_length(config, state)
    tuning = choose_hyperparameters(config, features, config_path, overrides)
    config = with_params(config, tuning.params)
    if warm:
        config, kept_shape = with_champion_shape(config, warm)
        if kept_shape:
            logger.warning("%s", kept_shape)
    training = train_model(config, state, feature_files, warm.checkpoint if warm else "")
    report, scores = evaluate_model(config, state, feature_files, str(training.out_dir))
    model = export_task(config, state, feature_files, training.summary.checkpoint, str(training.out_dir))
    lineage = lineage_tags(night, state, keep_checkpoint(config, training.summary.checkpoint))
    tracked = _track(config, state, ingest, report, scores, training, model, {**tuning.as_tags(), **lineage},
                     started_at_ms)  # fmt: skip
    decision = None
    if tracked.model_version is not None:
        decision = promote_task(config, tracked.run_id, tracked.model_version, report)
    if tracked.model_version is not None:  # a deferred run (MLflow unreachable) leaves pruning to the next
        try:
            prune_lineage(config, MlflowClient(tracking_uri=config.tracking_uri))
        except Exception as error:  # noqa: BLE001 - the registry went away after promotion
            logger.warning("kept checkpoints not pruned (%s); the next run prunes them", error)
    result = PipelineResult(config, ingest, report, training, tracked, decision, tuning, night)
    _publish_artifacts(result)
    logger.info("pipeline finished in %.0f s; MLflow run %s", time.perf_counter() - started, tracked.run_id)
    return result


@dataclass(frozen=True)
class SkippedNight:
    """A run as of a day that is already covered: nothing trained (flows/recurring.py)."""

    summary: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.summary)


def _plan(config: PipelineConfig, as_of: str | int | None) -> tuple[Night, PipelineConfig]:
    """The run's night (a plain run: the configured days) and its config."""
    day = resolve_as_of(config, as_of)
    if day is None:
        return Night(None, config.data.train_days), config
    night = plan_night(config, day, MlflowClient(tracking_uri=config.tracking_uri))
    if night.note:
        get_run_logger().info("as of day %s: %s", config.data.shown(day), night.note)
    return night, (config if night.skipped else night_config(config, night))


@flow(name="train", on_crashed=[cancel_when_stopped])
def train_model(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]],
                warm_start: str = "") -> TrainedModel:  # fmt: skip
    """Sharded training with torchrun on the train days (from `warm_start`'s checkpoint
    when given); the job's summary and outputs."""
    return train_task(config, state, files, warm_start)


@flow(name="evaluate", on_crashed=[cancel_when_stopped])
def evaluate_model(
    config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]], train_out: str
) -> tuple[EvalReport, dict[int, Scores]]:
    """The model's held-out report against the reference predictors, on the eval days."""
    lr_scores = baseline_task(config, state, files)
    return evaluate_task(config, state, train_out, lr_scores)


def _track(
    config: PipelineConfig, state: PreprocessState, ingest, report: EvalReport, scores: dict[int, Scores],
    training: TrainedModel, model, tuning_tags: dict[str, str], started_at_ms: int,
) -> TrackedRun:
    out, summary = training.out_dir, training.summary
    resolved = config_as_dict(config)
    log = get_run_logger()
    online = wait_for_tracking(config.tracking_uri, config.tracking.outage_wait_s, log)
    everything = Scores.concat([scores[day] for day in config.data.eval_days])
    record = RunRecord(
        run_name=f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}",
        params=flatten(resolved),
        config=resolved,
        metrics={
            **report.flat_metrics(),
            "rows_ingested": float(sum(r["rows_written"] for r in ingest)),
            "rows_quarantined": float(sum(r["rows_quarantined"] for r in ingest)),
            "train_samples_per_s_overall": summary.samples_per_s,
            "train_steps": float(summary.steps),
            "train_seconds": summary.seconds,
        },
        history=read_metrics_history(out / "metrics.jsonl"),
        artifacts={"training": [out / "plan.txt", out / "plan.json", out / "summary.json"]},
        documents={
            "preprocessing/state.json": asdict(state),
            "evaluation/slices.json": report.slices,
            "evaluation/per_day.json": {str(d): m for d, m in report.per_day.items()},
        },
        texts={"evaluation/report.md": report_markdown(report, f"Evaluation: {config.name}")},
        eval_predictions=(everything.labels.astype(float), everything.predictions.astype(float)),
        baseline_history=_champion_history(config) if online else None,
        tags={
            "pipeline.config": config.name,
            # where and how it trained; summary.json (in "training") also names the CPU kernels
            "training.world_size": str(summary.world_size),
            "training.device": summary.device,
            "training.precision": summary.precision,  # what `auto` resolved to on this device
            "evaluation.days": ",".join(map(str, config.data.eval_days)),
            **tuning_tags,
        },
        start_time_ms=started_at_ms,
    )
    return track_or_defer(
        Path(config.run_dir).resolve(), config.tracking_uri, config.artifact_location, config.tracking.experiment,
        config.tracking.registered_model, 0.0 if not online else config.tracking.outage_wait_s, record, model, log,
    )  # fmt: skip


def _champion_history(config: PipelineConfig) -> list[dict[str, float]] | None:
    """The current champion's training history, for the relative-NE plot (None if none)."""
    client = MlflowClient(tracking_uri=config.tracking_uri)
    try:
        champion = current_champion(client, config.tracking.registered_model)
    except Exception:  # noqa: BLE001 - a missing registry only means there is nothing to compare with
        return None
    return run_history(config.tracking_uri, champion.run_id) if champion and champion.run_id else None


def _publish_artifacts(result: PipelineResult) -> None:
    """Prefect artifacts: the per-day table and a Markdown summary with the decision."""
    create_table_artifact(
        key="evaluation-by-day",
        table=[{"day": day, **{k: round(v, 6) for k, v in m.items()}} for day, m in result.report.per_day.items()],
        description="Held-out metrics per evaluation day",
    )
    champion = result.decision.champion_ne if result.decision else None
    decision = f"\n**Promotion:** {result.as_dict()['promotion_reason']}\n" if result.decision else ""
    summary, trained = result.as_dict(), result.training.summary
    create_markdown_artifact(
        key="pipeline-summary",
        markdown=(
            report_markdown(result.report, f"DLRM pipeline: {result.config.name}", champion)
            + decision
            + f"\n**Training:** {summary['train_samples_per_s']:,.0f} samples/s, "
            f"{trained.world_size} processes on {trained.device} in {trained.precision}\n"
            + f"\n**MLflow run:** {_run_link(result)} (model version {result.tracked.model_version})\n"
        ),
        description="Held-out quality against references and the champion, throughput, MLflow run",
    )


def _run_link(result: PipelineResult) -> str:
    """A link into the MLflow UI (for a local store: the `mlflow ui` the summary prints)."""
    tracked = result.tracked
    if not tracked.experiment_id:
        return f"`{tracked.run_id}`"
    return f"[{tracked.run_id}]({run_url(ui_address(result.config.tracking_uri), tracked.experiment_id, tracked.run_id)})"


def run_pipeline(config_path: str, overrides: list[str] | None = None, as_of: str | None = None) -> dict[str, Any]:
    """Run the flow with as many parallel stage tasks as the config allows."""
    config = load_config(config_path, overrides or [])
    runner = ThreadPoolTaskRunner(max_workers=config.orchestration.max_workers)
    return pipeline.with_options(task_runner=runner)(config_path=config_path, overrides=overrides or [], as_of=as_of)
