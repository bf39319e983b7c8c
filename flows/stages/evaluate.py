"""After training: the model judged on the evaluation days beside the reference predictors,
its files for serving, and the promotion that compares it with the champion."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from prefect import flow, get_run_logger, task
from prefect.tasks import exponential_backoff

from evaluation.calibration import Calibrator
from evaluation.metrics import BinaryState, binary_state, compute_ne
from evaluation.promotion import PromotionDecision, QualityEvidence, QualityGate, quality_failure
from evaluation.report import EvalReport, Scores, build_report
from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from flows.run.job import TrainedModel, build_job
from flows.stages import heartbeats
from flows.stages.features import STAGE
from flows.stages.stopped_runs import cancel_when_stopped
from flows.tracking.registry import promote_if_better, promotion_lock, record_promotion, registered_scorer
from flows.tracking.runs import logged_state_or_none, tracking_client
from ingestion.preprocess import PreprocessState, apply_state
from ingestion.synthetic import read_day_stats
from training.job import JobFolder
from training.reference_cache import fitted_reference
from training.serving.export import ServingModel, write_serving_model
from training.serving.scoring import score_files
from training.threads import intra_op_threads

heartbeats.install()  # this module's flow runs end when their work ends

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

DayScores = dict[int | str, Scores]  # day as the config writes it → its scores


@flow(name="evaluate", on_crashed=[cancel_when_stopped])
def evaluate_model(config: PipelineConfig, features: Features, folder: JobFolder, train_files: tuple[str, ...],
                   calibrator: Calibrator) -> tuple[EvalReport, DayScores]:  # fmt: skip
    """The served (calibrated) model's held-out report against the reference predictors, on
    the eval days; the references train on the rows the model trained on (`train_files`)."""
    lr_scores = baseline_task(config, features, train_files)
    return evaluate_task(config, features.state, folder, lr_scores, calibrator)


@task(name="baseline-logistic-regression", **STAGE)
def baseline_task(config: PipelineConfig, features: Features, train_files: tuple[str, ...]) -> DayScores:
    """The hashed logistic regression on the DLRM's features: L2 chosen on held-out training
    rows (k-fold cross-validation on few rows), refit on all of them to convergence, scored on
    the same rows as the model (training/reference.py)."""
    data = config.data
    # the cores the training used, whatever this process was started with: the same rows give the same fit
    with intra_op_threads(max(1, config.training.nproc * config.training.threads_per_proc)):
        reference = fitted_reference(features.state.table_sizes, train_files,
                                     max_rows=config.evaluation.reference_max_rows,
                                     folds=config.evaluation.reference_folds, raw_ids=features.state.mode == "managed")
    fit = reference.fit
    get_run_logger().info(
        "logistic regression: %s, refit on %s; %s", reference.how_chosen,
        f"all {fit.train_rows:,}" if fit.train_rows == fit.rows_available else
        f"{fit.train_rows:,} of {fit.rows_available:,} (a hashed sample: evaluation.reference_max_rows)",
        "converged" if fit.converged else f"stopped after {fit.iterations} iterations without converging",
    )  # fmt: skip
    slice_feature = config.evaluation.slice_feature
    return {data.shown(day): score_files(fit.model, features.files[day], slice_feature) for day in data.eval_days}


@task(name="evaluate", **STAGE)
def evaluate_task(config: PipelineConfig, state: PreprocessState, folder: JobFolder, lr_scores: DayScores,
                  calibrator: Calibrator) -> tuple[EvalReport, DayScores]:  # fmt: skip
    """The served model's report on the held-out days (its probabilities calibrated, beside
    them before), beside the reference predictors; and its scores per day (read once, also
    used for the plots)."""
    data = config.data
    raw = {data.shown(day): folder.read_predictions(data.day_label(day)) for day in data.eval_days}
    scores = {day: dataclasses.replace(s, predictions=calibrator.apply(s.predictions)) for day, s in raw.items()}
    constant = {
        day: Scores(s.labels, np.full(s.labels.shape, state.train_click_rate)) for day, s in scores.items()
    }  # every example gets the training days' click rate
    bayes = _bayes_state(config)
    report = build_report(
        scores,
        config.evaluation.slice_top_k,
        reference_scores={"baseline_constant": constant, "logistic_regression": lr_scores},
        reference_states={"bayes": bayes} if bayes else None,
        uncalibrated=raw if config.evaluation.calibration != "none" else None,
    )
    before = report.uncalibrated
    get_run_logger().info(
        "eval days %s: NE %.4f  AUC %.4f  calibration %.3f%s | logistic regression NE %.4f | Bayes-optimal NE %s",
        list(scores), report.overall["ne"], report.overall["auc"], report.overall["calibration"],
        f" (before calibration: NE {before['ne']:.4f}, calibration {before['calibration']:.3f})" if before else "",
        report.references["logistic_regression_ne"],
        f"{report.references['bayes_ne']:.4f}" if bayes else "n/a",
    )  # fmt: skip
    return report, scores


def _bayes_state(config: PipelineConfig) -> BinaryState | None:
    """The generator's Bayes-optimal predictions on the eval days, as a summed state."""
    if config.data.source != "synthetic":
        return None
    raw = config.path(config.data.raw_dir)
    stats = [read_day_stats(raw, day) for day in config.data.eval_days]
    if any(s is None for s in stats):
        return None
    return BinaryState(
        count=sum(s.rows for s in stats),
        label_sum=sum(s.clicks for s in stats),
        cross_entropy_sum=sum(s.bayes_log_loss * s.rows for s in stats),
    )


@task(name="export-model", **STAGE)
def export_task(config: PipelineConfig, features: Features, trained: TrainedModel, calibrator: Calibrator,
                warm_start: str = "") -> ServingModel:  # fmt: skip
    """The registered model's files: weights, shape, preprocessing state and calibrator (the
    job folder's `serving`); a run that continued `warm_start` (a checkpoint) also the rows
    it changed in that model."""
    return write_serving_model(build_job(config, features, warm_start), Path(trained.summary.checkpoint), features.state,
                               config.path(config.preprocess.features_dir), trained.folder.serving,
                               config.tracking.serving_device, calibrator)  # fmt: skip


@task(name="promote", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5), **STAGE)
def promote_task(config: PipelineConfig, run_id: str, version: str, report: EvalReport) -> PromotionDecision:
    """Make the new version the champion if it beats the current one on the same days."""
    client = tracking_client(config.tracking_uri)
    name = config.tracking.registered_model
    evidence = QualityEvidence(report.references["baseline_constant_ne"], report.references["logistic_regression_ne"],
                               report.overall["calibration"])  # fmt: skip
    gate = QualityGate.from_config(config.evaluation)
    decision = promote_if_better(
        client, name, version, report.overall["ne"], tuple(config.data.shown_days(config.data.eval_days)),
        config.evaluation.promotion_margin,
        champion_ne_on_days=lambda champion: champion_ne(config, champion),
        lock=promotion_lock(config.tracking_uri, config.tracking.promotion_lock, name),
        evidence=evidence, gate=gate,
    )  # fmt: skip
    record_promotion(client, run_id, decision, refused=quality_failure(report.overall["ne"], evidence, gate) is not None)
    get_run_logger().info("promotion: %s (%s)", "promoted" if decision.promote else "not promoted", decision.reason)
    return decision


def champion_ne(config: PipelineConfig, champion: ModelVersion) -> float | None:
    """The champion's NE on this run's eval days, as it serves (its own preprocessing state
    and calibrator)."""
    state = logged_state_or_none(config.tracking_uri, champion.run_id)
    if state is None:
        return None  # a champion without its preprocessing state cannot score new days
    try:
        _, calibrator, logits_of = registered_scorer(f"models:/{config.tracking.registered_model}/{champion.version}",
                                                     config.tracking_uri)  # fmt: skip
    except Exception as error:  # noqa: BLE001 - e.g. a version pickled with classes this release no longer has
        get_run_logger().warning("champion version %s cannot be loaded (%s): it cannot be compared, so nothing "
                                 "is promoted; set the alias by hand to move on", champion.version, error)  # fmt: skip
        return None
    warehouse, features_root = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    parts = []
    for day in config.data.eval_days:
        folder = apply_state(config.preprocess, state, warehouse, features_root, day)
        files = [str(p) for p in sorted(folder.glob("*.parquet"))]
        parts.append(score_files(logits_of, files, config.evaluation.slice_feature))
    joined = Scores.concat(parts)
    return compute_ne(binary_state(joined.labels, calibrator.apply(joined.predictions)))
