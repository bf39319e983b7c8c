"""The `pipeline` flow: generate (demo) → ingest → preprocess → resolve the run → train →
calibrate → evaluate → track → promote.

    night = plan_night(config, as_of)                        # the days, the champion it continues
    features = prepare_features(resolve_run(config, night).config)
    decision = choose_hyperparameters(resolve_run(config, night, state), ...)
    run = resolve_run(config, night, state, decision)        # what every later step reads
    rows = training_rows(run.config, features)               # less the calibration rows
    trained = train_model(run.config, ...) → calibrate → evaluate → export → track → promote
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from training.launch.interpreter import imports_without_collection

# A deployment's flow run (`python -m prefect.engine`, from `dlrm serve` or a worker) imports
# this file first: its imports with the collector paused, as a command's and a rank's are
# (training/launch/interpreter.py; bench/start_up.py's deployment start-ups)
with imports_without_collection():
    from prefect import flow, get_run_logger
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.task_runners import ThreadPoolTaskRunner

    from evaluation.calibration import Calibrator
    from evaluation.promotion import PromotionDecision
    from evaluation.report import EvalReport, Scores, report_markdown
    from flows.run.config import (
        ConfigSource,
        PipelineConfig,
        config_as_dict,
        flatten,
        load_config,
        load_flow_config,
    )
    from flows.run.crosses import with_run_crosses
    from flows.run.feature_files import Features
    from flows.run.job import TrainedModel
    from flows.run.nights import Night, waits_for_rows
    from flows.run.reports import RunSummary, SkippedNight
    from flows.run.resolve import ResolvedRun, resolve_run
    from flows.run.rows import training_rows
    from flows.run.sources import resolve_as_of
    from flows.stages import heartbeats
    from flows.stages.calibrate import calibrate_task
    from flows.stages.evaluate import DayScores, champion_ne, evaluate_model, export_task, promote_task
    from flows.stages.features import prepare_features
    from flows.stages.stopped_runs import cancel_when_stopped
    from flows.stages.train import train_model
    from flows.tracking.deferred import track_or_defer, wait_for_tracking
    from flows.tracking.lineage import (
        TAG_ROWS_CHANGED,
        StaleChampionError,
        champion_staleness,
        keep_checkpoint,
        lineage_tags,
        plan_night,
        prune_lineage,
        skipped_summary,
    )
    from flows.tracking.registry import current_champion
    from flows.tracking.runs import (
        RunRecord,
        TrackedRun,
        read_metrics_history,
        run_history,
        run_url,
        tracking_client,
        ui_address,
    )
    from flows.tuning.hyperparameters import choose_hyperparameters
    from flows.tuning.port import port_summary, with_batch
    from training.codec import encode
    from training.serving.export import ServingModel

heartbeats.install()  # this module's flow runs end when their work ends


@flow(name="pipeline", log_prints=True, on_crashed=[cancel_when_stopped])
def pipeline(config_path: str = "configs/demo.toml", overrides: list[str] | None = None,
             as_of: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole slice on one config; returns the summary (also published as artifacts).
    `as_of`: a day, or "newest" (the newest complete one): continue the champion on the
    days before it that it has not seen and judge on that day (flows/run/nights.py)."""
    source = ConfigSource(config_path, tuple(overrides or ()))
    return encode(run_stages(load_flow_config(config_path, source.overrides), source, as_of))


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
    source = ConfigSource(config_path, (*(overrides or []), *extra))
    return encode(run_stages(load_flow_config(config_path, source.overrides), source))


@flow(name="pipeline", log_prints=True, on_crashed=[cancel_when_stopped])
def pipeline_of(config: PipelineConfig, source: ConfigSource, as_of: str | None = None) -> dict[str, Any]:
    """The `pipeline` flow on a config the caller has loaded (the `dlrm` command reads its file once)."""
    return encode(run_stages(config, source, as_of))


def run_pipeline(config_path: str, overrides: list[str] | None = None, as_of: str | None = None,
                 config: PipelineConfig | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the flow with as many parallel stage tasks as the config allows; `config`: the
    file's config with the overrides, when the caller has loaded it already."""
    config = config or load_config(config_path, overrides or [])
    return _pipeline_on(config.orchestration.max_workers)(config, ConfigSource(config_path, tuple(overrides or ())), as_of)


@functools.cache
def _pipeline_on(max_workers: int):
    """`pipeline_of` on a thread pool of `max_workers`, made once per size (see
    `flows.stages.features._on_runner`: a new flow's schema costs 0.17 s; a run duplicates the runner)."""
    return pipeline_of.with_options(task_runner=ThreadPoolTaskRunner(max_workers=max_workers))


def run_stages(config: PipelineConfig, source: ConfigSource, as_of: str | int | None = None) -> RunSummary | SkippedNight:
    logger = get_run_logger()
    started, started_at_ms = time.perf_counter(), int(time.time() * 1000)
    night = _plan(config, as_of)
    if night.skipped:
        logger.info("as of day %s: %s", config.data.shown(night.as_of), night.skipped)
        return skipped_summary(night, tracking_client(config.tracking_uri), config)
    nightly = resolve_run(config, night).config  # the night's days, before the data is known
    features = prepare_features(nightly, night.warm_start.state if night.warm_start else None)
    waiting = waits_for_rows(nightly, night, features.state.train_rows)
    if waiting:  # the new days stay ingested; the next night trains them with its own
        logger.info("as of day %s: %s", config.data.shown(night.as_of), waiting)
        return _waiting_night(nightly, night, waiting)
    features, crossed = with_run_crosses(resolve_run(config, night, features.state), features)
    if crossed:
        logger.info("%s", crossed)
    decision = choose_hyperparameters(resolve_run(config, night, features.state), features, source,
                                      lambda batch: resolve_run(with_batch(config, batch), night, features.state))  # fmt: skip
    run = resolve_run(config, night, features.state, decision)
    for line in run.change_lines():
        logger.info("%s", line)
    config = run.config
    rows = training_rows(config, features, night.lineage_days, continues=night.warm_start is not None)
    trained = train_model(config, features, night.warm_checkpoint, rows)
    calibrator = calibrate_task(config, trained.folder)
    report, scores = evaluate_model(config, features, trained.folder, rows.model_files(trained.summary.refit), calibrator)
    model = export_task(config, features, trained, calibrator, night.warm_checkpoint)
    lineage = lineage_tags(config, night, features.state, keep_checkpoint(config, trained.summary.checkpoint))
    tracked = _track(run, features, report, scores, trained, model, lineage, started_at_ms, calibrator)
    decision_ = promote_task(config, tracked.run_id, tracked.model_version, report) if tracked.model_version else None
    if tracked.model_version is not None:  # a deferred run (MLflow unreachable) leaves pruning to the next
        try:
            prune_lineage(config, tracking_client(config.tracking_uri))
        except Exception as error:  # noqa: BLE001 - the registry went away after promotion
            logger.warning("kept checkpoints not pruned (%s); the next run prunes them", error)
    summary = run_summary(run, features, report, trained, tracked, decision_, calibrator, rows.calibration_rows, model)
    _publish_artifacts(run, summary, report, trained)
    if night.as_of is not None and tracked.model_version is not None:
        _judge_staleness(config)
    logger.info("pipeline finished in %.0f s; MLflow run %s", time.perf_counter() - started, tracked.run_id)
    return summary


def _waiting_night(config: PipelineConfig, night: Night, reason: str) -> SkippedNight:
    """The summary of a night that waits for more rows: the model that keeps serving (the
    champion) judged on the night's day, as every night judges what it serves."""
    client = tracking_client(config.tracking_uri)
    champion = current_champion(client, config.tracking.registered_model)
    serving = str(champion.version) if champion else night.warm_start.version if night.warm_start else None
    summary = skipped_summary(dataclasses.replace(night, skipped=reason, earlier_version=serving), client, config)
    served_ne = champion_ne(config, champion) if champion else None
    if served_ne is not None:
        get_run_logger().info("as of day %s: champion version %s, which keeps serving, scores NE %.5f on it",
                              config.data.shown(night.as_of), serving, served_ne)  # fmt: skip
    return dataclasses.replace(summary, eval_ne=served_ne)


def _judge_staleness(config: PipelineConfig) -> None:
    """Tag the champion's age on the registered model; a stale champion ends the night as
    `orchestration.on_stale` says (Failed: what a Prefect notification watches)."""
    staleness = champion_staleness(config, tracking_client(config.tracking_uri))
    if not staleness.stale:
        return
    if config.orchestration.on_stale == "fail":
        raise StaleChampionError(staleness.message)
    get_run_logger().warning("stale champion: %s", staleness.message)
    create_markdown_artifact(key="stale-champion", markdown=f"# Stale champion\n\n{staleness.message}\n",
                             description="The champion has not been replaced for too many nights")  # fmt: skip


def _plan(config: PipelineConfig, as_of: str | int | None) -> Night:
    """The run's night: a plain run's is the configured days."""
    day = resolve_as_of(config, as_of)
    if day is None:
        return Night.plain(config)
    night = plan_night(config, day, tracking_client(config.tracking_uri))
    if night.note:
        get_run_logger().info("as of day %s: %s", config.data.shown(day), night.note)
    return night


def run_summary(run: ResolvedRun, features: Features, report: EvalReport, trained: TrainedModel, tracked: TrackedRun,
                decision: PromotionDecision | None, calibrator: Calibrator, calibration_rows: int,
                model: ServingModel) -> RunSummary:  # fmt: skip
    """What `dlrm run --json` prints: the resolved run's days, batch and key; the job's figures."""
    data, night, job = run.config.data, run.night, trained.summary
    assert run.tuning is not None, "a pipeline run is resolved with its tuning decision"
    source = run.tuning.source  # the tuned key the parameters come from, if any
    return RunSummary(
        as_of=None if night.as_of is None else data.shown(night.as_of),
        eval_days=data.shown_days(data.eval_days),
        days_trained=data.shown_days(data.train_days),
        lineage_days=data.shown_days(night.lineage_days),
        warm_start_version=night.warm_start.version if night.warm_start else None,
        rows_ingested=sum(r.rows_written for r in features.ingest),
        rows_quarantined=sum(r.rows_quarantined for r in features.ingest),
        files_failed=[e for r in features.ingest for e in r.files_failed],
        days_already_ingested=[data.shown(r.day) for r in features.ingest if r.skipped],
        metrics=report.flat_metrics(),
        train_samples_per_s=job.samples_per_s, samples_per_s=job.samples_per_s,
        rows_trained=job.rows_trained, checkpoint_bytes=job.checkpoint_bytes, resumed_from_step=job.resumed_from_step,
        rows_changed=model.rows_changed, table_rows=sum(features.state.model_table_sizes.values()),
        crosses=[cross.name for cross in features.state.crosses],
        count_bins={bins.feature: bins.rows for bins in features.state.count_bins},
        steps=job.steps,
        world_size=job.world_size, global_batch_size=job.global_batch_size,
        mlflow_run_id=tracked.run_id,
        mlflow_run_url=run_url(ui_address(run.config.tracking_uri), tracked.experiment_id, tracked.run_id)
        if tracked.experiment_id else None,
        model_version=tracked.model_version,
        promoted=bool(decision and decision.promote),
        promotion_reason=decision.reason if decision else "no model registered",
        champion_ne_same_days=decision.champion_ne if decision else None,
        tuning_key=run.key.fingerprint, tuning_decision=run.tuning.action, tuning_reason=run.tuning.reason,
        seed_spread=seed_spread(run), seed_spread_seeds=len(source.ne_per_seed) if source else 0,
        calibrator=calibrator.describe(), calibration_rows=calibration_rows, managed_churn=job.managed_churn,
        epochs_trained=job.epochs_trained, epochs_kept=job.epochs_kept, run_length=job.run_length, refit=job.refit,
        port=port_summary(run.config, run.tuning.port, trained.folder.metrics) if run.tuning.port else None,
    )  # fmt: skip


def seed_spread(run: ResolvedRun) -> float | None:
    """The seeds' spread of the trial the run's parameters come from; None where not measured."""
    source = run.tuning.source if run.tuning is not None else None
    return source.seed_spread if source is not None else None


def _track(run: ResolvedRun, features: Features, report: EvalReport, scores: DayScores, trained: TrainedModel,
           model: ServingModel, lineage: dict[str, str], started_at_ms: int, calibrator: Calibrator) -> TrackedRun:  # fmt: skip
    config, summary, folder = run.config, trained.summary, trained.folder
    resolved = config_as_dict(config)
    log = get_run_logger()
    online = wait_for_tracking(config.tracking_uri, config.tracking.outage_wait_s, log)
    everything = Scores.concat(list(scores.values()))
    assert run.tuning is not None
    record = RunRecord(
        run_name=f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}",
        params=flatten(resolved),
        config=resolved,
        metrics={
            **report.flat_metrics(),
            "rows_ingested": float(sum(r.rows_written for r in features.ingest)),
            "rows_quarantined": float(sum(r.rows_quarantined for r in features.ingest)),
            "train_samples_per_s_overall": summary.samples_per_s,
            "train_steps": float(summary.steps),
            "train_seconds": summary.seconds,
            "checkpoint_bytes": float(summary.checkpoint_bytes),
            **({"rows_changed": float(model.rows_changed)} if model.rows_changed is not None else {}),
            **({"seed_spread": spread} if (spread := seed_spread(run)) is not None else {}),
            **({"managed_ids_rounds": float(summary.managed_rounds),
                "managed_ids_restarted_rows": float(summary.managed_restarted_rows),
                "managed_ids_resident": float(summary.managed_resident_ids),
                "managed_ids_admitted": float(summary.managed_admitted_ids),
                "managed_ids_returned": float(summary.managed_returned_ids),
                "managed_ids_live": float(summary.managed_live_ids)} if summary.managed_rounds else {}),
            **({"epochs_trained": float(summary.epochs_trained), "epochs_kept": float(summary.epochs_kept)}
               if summary.run_length else {}),
        },
        # the validation NE by epochs trained: its own series, stepped by epoch
        history=read_metrics_history(folder.metrics) + [{"step": float(epochs), "validation_ne": ne}
                                                        for epochs, ne in summary.validation_ne.items() if ne is not None],
        artifacts={"training": [*folder.plan_files, folder.summary_file]},
        documents={
            "preprocessing/state.json": asdict(features.state),
            "evaluation/slices.json": report.slices,
            "evaluation/per_day.json": {str(day): metrics for day, metrics in report.per_day.items()},
            "config/resolved_changes.json": [asdict(change) for change in run.changes],
            "evaluation/calibrator.json": calibrator.as_dict(),
        },
        texts={"evaluation/report.md": report_markdown(report, f"Evaluation: {config.name}")},
        eval_predictions=(everything.labels.astype(float), everything.predictions.astype(float)),
        baseline_history=_champion_history(config) if online else None,
        tags={
            "pipeline.config": config.name,
            # where and how it trained; the summary (in "training") also names the CPU kernels
            "training.world_size": str(summary.world_size),
            "training.device": summary.device,
            "training.precision": summary.precision,  # what `auto` resolved to on this device
            **({"training.slurm_job_id": trained.slurm_job_id} if trained.slurm_job_id else {}),
            "evaluation.days": ",".join(config.data.day_label(day) for day in config.data.eval_days),
            "evaluation.calibration": calibrator.method,
            # the pairs crossed (`model.crosses`; the config's value says only "auto")
            **({"model.crossed_pairs": ",".join(c.name for c in features.state.crosses)} if features.state.crosses else {}),
            # the counts cut into bins (`model.count_bins`), and how many bins each
            **({"model.count_bins_cut": ",".join(f"{b.feature}:{b.rows}" for b in features.state.count_bins)}
               if features.state.count_bins else {}),
            **run.key.as_tags(), **run.tuning.as_tags(), **lineage,
            # on the registered version too: how many of its rows a serving tier must take
            **({TAG_ROWS_CHANGED: str(model.rows_changed)} if model.rows_changed is not None else {}),
        },
        start_time_ms=started_at_ms,
    )
    return track_or_defer(
        Path(config.run_dir).resolve(), config.tracking_uri, config.artifact_location, config.tracking.experiment,
        config.tracking.registered_model, 0.0 if not online else config.tracking.outage_wait_s, record, model, log,
    )  # fmt: skip


def _champion_history(config: PipelineConfig) -> list[dict[str, float]] | None:
    """The current champion's training history, for the relative-NE plot (None if none)."""
    client = tracking_client(config.tracking_uri)
    try:
        champion = current_champion(client, config.tracking.registered_model)
    except Exception:  # noqa: BLE001 - a missing registry only means there is nothing to compare with
        return None
    return run_history(config.tracking_uri, champion.run_id) if champion and champion.run_id else None


def _publish_artifacts(run: ResolvedRun, summary: RunSummary, report: EvalReport, trained: TrainedModel) -> None:
    """Prefect artifacts: the per-day table and a Markdown summary with the decision."""
    create_table_artifact(
        key="evaluation-by-day",
        table=[{"day": day, **{k: round(v, 6) for k, v in m.items()}} for day, m in report.per_day.items()],
        description="Held-out metrics per evaluation day",
    )
    job = trained.summary
    decision = f"\n**Promotion:** {summary.promotion_reason}\n" if summary.model_version else ""
    create_markdown_artifact(
        key="pipeline-summary",
        markdown=(
            report_markdown(report, f"DLRM pipeline: {run.config.name}", summary.champion_ne_same_days)
            + decision
            + f"\n**Calibration:** {summary.calibrator}\n"
            + f"\n**Training:** {job.samples_per_s:,.0f} samples/s, {job.world_size} processes on {job.device} in "
            f"{job.precision}, global batch {job.global_batch_size:,} (tuning key {summary.tuning_key})\n"
            + f"\n**MLflow run:** {_run_link(summary)} (model version {summary.model_version})\n"
        ),
        description="Held-out quality against references and the champion, throughput, MLflow run",
    )


def _run_link(summary: RunSummary) -> str:
    """A link into the MLflow UI (for a local store: the `mlflow ui` the summary prints)."""
    return f"[{summary.mlflow_run_id}]({summary.mlflow_run_url})" if summary.mlflow_run_url else f"`{summary.mlflow_run_id}`"
