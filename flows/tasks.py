"""Prefect tasks: each one calls library code of one package and returns plain results."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pyarrow.parquet as pq
import torch
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from evaluation.metrics import BinaryState, binary_state, compute_ne
from evaluation.promotion import PromotionDecision, QualityEvidence, QualityGate, quality_failure
from evaluation.report import EvalReport, Scores, build_report
from flows.config import ConfigError, PipelineConfig
from flows.registry import decision_tag, promote_if_better, promotion_lock
from flows.tracking import logged_state
from flows.trainer_hosts import train_on_hosts
from flows.trainer_slots import trainer_slot
from ingestion.parquet_source import SchemaChangeError, ingest_parquet_day
from ingestion.preprocess import PreprocessState, apply_state, continue_state, fit_state
from ingestion.synthetic import GroundTruth, existing_day, generate_day, read_day_stats
from ingestion.warehouse import ingest_day
from training.baselines import fit_logistic_regression
from training.export import ServingModel, write_serving_model
from training.job import TrainJob
from training.launcher import launch
from training.progress import MetricsRecord
from training.resume import job_fingerprint
from training.scoring import dlrm_logits, score_files
from training.summary import TrainSummary

# Work is skipped by the stages' own manifests (a day already ingested, features already
# written for this preprocessing state), which stay right when files change underneath;
# Prefect's input-hash cache would not.
STAGE = {"cache_policy": NO_CACHE}


@task(name="generate-day", **STAGE)
def generate_task(config: PipelineConfig, day: int) -> dict[str, Any]:
    raw = config.path(config.data.raw_dir)
    existing = existing_day(config.data.synthetic, raw, day, config.data.multi_hot)
    if existing:
        get_run_logger().info("day %d: generated earlier with the same settings, reusing it", day)
        return asdict(existing)
    stats = generate_day(config.data.synthetic, day, raw, GroundTruth(config.data.synthetic, config.data.multi_hot))
    get_run_logger().info("day %d: generated %s rows, Bayes-optimal NE %.4f", day, f"{stats.rows:,}", stats.bayes_ne)
    return asdict(stats)


def _worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """A changed schema stays changed: only other failures (a flaky mount, a store) retry."""
    try:
        state.result()
    except SchemaChangeError:
        return False
    except Exception:  # noqa: BLE001 (any other failure is worth another try)
        return True
    return True


@task(name="ingest-day", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5),
      retry_condition_fn=_worth_retrying, **STAGE)  # fmt: skip
def ingest_task(config: PipelineConfig, day: int, sources: list[str]) -> dict[str, Any]:
    warehouse = config.path(config.data.warehouse_dir)
    if config.data.source == "parquet":
        report = ingest_parquet_day(sources, day, warehouse, config.data)
    else:
        report = ingest_day(sources, day, warehouse, multi_hot=config.data.multi_hot)
    logger = get_run_logger()
    for failed in report.files_failed:
        logger.error("%s", failed.error)
    logger.info(
        "day %s: %s rows read, %s written, %s quarantined%s",
        config.data.shown(day), f"{report.rows_read:,}", f"{report.rows_written:,}",
        f"{report.rows_quarantined:,}", " (already ingested, skipped)" if report.skipped else "",
    )  # fmt: skip
    return {
        "day": day,
        "rows_read": report.rows_read,
        "rows_written": report.rows_written,
        "rows_quarantined": report.rows_quarantined,
        "files_failed": [f.error for f in report.files_failed],
        "skipped": report.skipped,
        # per file: read = written + quarantined
        "files": [{"source": f.source, "rows_read": f.rows_read, "rows_written": f.rows_written,
                   "rows_quarantined": f.rows_quarantined} for f in report.files if f.error is None],
    }


@task(name="fit-preprocessing", **STAGE)
def fit_task(config: PipelineConfig, parent: PreprocessState | None = None) -> PreprocessState:
    """Fit the state on the training days; for a run continuing a model, extend the
    model's own state (`parent`) with them instead."""
    warehouse, features_root = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    if parent is not None:
        return continue_state(config.preprocess, parent, warehouse, features_root, config.data.train_days)
    return fit_state(config.preprocess, warehouse, features_root, config.data.train_days)


@task(name="preprocess-day", **STAGE)
def preprocess_task(config: PipelineConfig, state: PreprocessState, day: int) -> list[str]:
    folder = apply_state(
        config.preprocess, state, config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir), day
    )
    return [str(p) for p in sorted(folder.glob("*.parquet"))]


@dataclass(frozen=True)
class TrainedModel:
    """A finished training job: its summary, and the folder of its outputs (checkpoints,
    predictions of the eval days, metrics, plan)."""

    summary: TrainSummary
    out_dir: Path


@task(name="train", retries=1, retry_delay_seconds=2, **STAGE)
def train_task(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]],
               warm_start: str = "") -> TrainedModel:  # fmt: skip
    """Sharded training with torchrun; returns the job's summary and where its outputs are.

    A retry of this task, or the same command after an interruption, resumes from the
    job's last checkpoint; a job that ran to its end trains again (training/resume.py).
    `warm_start`: a checkpoint to continue (weights and optimizer state).
    """
    job = build_job(config, state, files, warm_start=warm_start)
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, key="training-progress", description="Training steps done (%)")
    shown = [0.0]

    def on_progress(record: MetricsRecord) -> None:
        done = 100.0 * record.step / max(1, record.total_steps)
        if done >= shown[0] + 1:  # at most ~100 updates a run
            shown[0] = done
            update_progress_artifact(progress, done)

    hosts = config.orchestration
    with trainer_slot(config, logger):
        if hosts.trainer_hosts > 1:
            train_on_hosts(job, hosts.trainer_hosts, hosts.rdzv_endpoint, logger.info)
        else:
            launch(job, on_line=logger.info, on_progress=on_progress)
    update_progress_artifact(progress, 100.0)
    _publish_plan(job.out / "plan.json")
    return TrainedModel(TrainSummary.load(job.out / "summary.json"), job.out)


def _publish_plan(plan_file: Path) -> None:
    """The sharding plan as a Prefect table: table → sharding type → ranks → bytes per rank."""
    if not plan_file.is_file():
        return
    rows = [
        {"table": row["table"], "sharding_type": row["sharding_type"], "compute_kernel": row["compute_kernel"],
         "ranks": ",".join(map(str, row["ranks"])),
         "bytes_per_rank": ", ".join(f"{rank}: {size:,}" for rank, size in row["bytes_per_rank"].items())}
        for row in json.loads(plan_file.read_text())
    ]  # fmt: skip
    create_table_artifact(key="sharding-plan", table=rows, description="Where each embedding table lives")


MULTI_HOST_ARGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv", "--master", "--standalone")


def refuse_hosts_in_torchrun_args(config: PipelineConfig) -> None:
    """Hosts are `dlrm train`'s options: torchrun arguments for them would start a job whose
    hosts do not know each other's part (who writes the summary, who clears the folder)."""
    given = [arg for arg in config.training.torchrun_args if arg.startswith(MULTI_HOST_ARGS)]
    if given:
        raise ConfigError(f"training.torchrun_args: {given} set the hosts of the job; run `dlrm train --nnodes N "
                          "--node-rank R --rdzv-endpoint HOST:PORT` on each host instead (README: Running on "
                          "several hosts)")  # fmt: skip


def build_job(
    config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]], run_id: str | None = None,
    warm_start: str = "",
) -> TrainJob:
    """The job of the config's training stage. Its checkpoints go to `run_id`'s folder; by
    default, the job's fingerprint, so the same command resumes an interrupted run.
    `warm_start`: start from that checkpoint's weights and optimizer state."""
    refuse_hosts_in_torchrun_args(config)
    job = TrainJob(
        model=config.model,
        sharding=config.sharding,
        training=config.training,
        evaluation=config.evaluation,
        table_sizes=state.table_sizes,
        train_files=tuple(f for day in config.data.train_days for f in files[day]),
        eval_files={str(day): tuple(files[day]) for day in config.data.eval_days},
        out_dir=str(config.path("train")),
        run_id=run_id or "",
        pooling_factors=dict(state.multi_hot),
        dense_features=len(state.dense),
        initial_click_rate=state.train_click_rate if config.training.start_at_click_rate else 0.0,
        init_checkpoint=warm_start,
        init_optimizer=bool(warm_start),
    )
    return job if run_id else dataclasses.replace(job, run_id=job_fingerprint(job))


@task(name="baseline-logistic-regression", **STAGE)
def baseline_task(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]]) -> dict[int, Scores]:
    """The hashed logistic regression on the DLRM's features: L2 chosen on a held-out slice of
    the training rows, refit on all of them to convergence, scored on the same rows as the
    model (training/baselines.py)."""
    torch.set_num_threads(max(1, config.training.nproc * config.training.threads_per_proc))
    train_files = [f for day in config.data.train_days for f in files[day]]
    fit = fit_logistic_regression(state.table_sizes, train_files, seed=config.training.seed,
                                  max_rows=config.evaluation.reference_max_rows)  # fmt: skip
    get_run_logger().info(
        "logistic regression: L2 chosen on %s held-out training rows (C %.4g, validation NE %.4f), refit on %s; %s",
        f"{fit.validation_rows:,}", fit.c, fit.validation_ne,
        f"all {fit.train_rows:,}" if fit.train_rows == fit.rows_available else
        f"{fit.train_rows:,} of {fit.rows_available:,} (a hashed sample: evaluation.reference_max_rows)",
        "converged" if fit.converged else f"stopped after {fit.iterations} iterations without converging",
    )  # fmt: skip
    return {day: score_files(fit.model, files[day], config.evaluation.slice_feature) for day in config.data.eval_days}


@task(name="evaluate", **STAGE)
def evaluate_task(
    config: PipelineConfig, state: PreprocessState, train_out: str, lr_scores: dict[int, Scores]
) -> tuple[EvalReport, dict[int, Scores]]:
    """The model's report on the held-out days, beside the reference predictors; and the
    model's scores per day (read once, also used for the plots)."""
    scores = {day: read_predictions(Path(train_out) / "predictions" / f"day={day}") for day in config.data.eval_days}
    constant = {
        day: Scores(s.labels, np.full(s.labels.shape, state.train_click_rate)) for day, s in scores.items()
    }  # every example gets the training days' click rate
    bayes = _bayes_state(config)
    report = build_report(
        scores,
        config.evaluation.slice_top_k,
        reference_scores={"baseline_constant": constant, "logistic_regression": lr_scores},
        reference_states={"bayes": bayes} if bayes else None,
    )
    get_run_logger().info(
        "eval days %s: NE %.4f  AUC %.4f  calibration %.3f | logistic regression NE %.4f | Bayes-optimal NE %s",
        config.data.shown_days(config.data.eval_days), report.overall["ne"], report.overall["auc"], report.overall["calibration"],
        report.references["logistic_regression_ne"],
        f"{report.references['bayes_ne']:.4f}" if bayes else "n/a",
    )  # fmt: skip
    return report, scores


def read_predictions(folder: Path) -> Scores:
    table = pq.read_table(sorted(folder.glob("*.parquet")), partitioning=None)
    return Scores(table["label"].to_numpy(), table["prediction"].to_numpy(), table["slice"].to_numpy())


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
def export_task(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]], checkpoint: str,
                train_out: str) -> ServingModel:  # fmt: skip
    """The registered model's files: weights, shape and preprocessing state (`<train_out>/serving`)."""
    return write_serving_model(build_job(config, state, files), Path(checkpoint), state,
                               config.path(config.preprocess.features_dir), Path(train_out) / "serving",
                               config.tracking.serving_device)  # fmt: skip


@task(name="promote", retries=3, retry_delay_seconds=exponential_backoff(backoff_factor=5), **STAGE)
def promote_task(config: PipelineConfig, run_id: str, version: str, report: EvalReport) -> PromotionDecision:
    """Make the new version the champion if it beats the current one on the same days."""
    client = MlflowClient(tracking_uri=config.tracking_uri)
    name = config.tracking.registered_model
    evidence = QualityEvidence(report.references["baseline_constant_ne"], report.references["logistic_regression_ne"],
                               report.overall["calibration"])  # fmt: skip
    gate = QualityGate.from_config(config.evaluation)
    decision = promote_if_better(
        client, name, version, report.overall["ne"], tuple(config.data.eval_days),
        config.evaluation.promotion_margin,
        champion_ne_on_days=lambda champion: champion_ne(config, champion),
        lock=promotion_lock(config.tracking_uri, config.tracking.promotion_lock, name),
        evidence=evidence, gate=gate,
    )  # fmt: skip
    client.log_dict(run_id, decision.as_dict(), "promotion/decision.json")
    refused = quality_failure(report.overall["ne"], evidence, gate) is not None
    client.set_tag(run_id, "promotion.decision", decision_tag(decision, refused))
    client.set_tag(run_id, "promotion.reason", decision.reason)
    if decision.champion_ne is not None:
        client.log_metric(run_id, "champion_ne_same_days", decision.champion_ne)
    get_run_logger().info("promotion: %s (%s)", "promoted" if decision.promote else "not promoted", decision.reason)
    return decision


def registered_dlrm(model_uri: str) -> torch.nn.Module:
    """The DLRM of a registered version, on CPU: inside this project's pyfunc, or the module
    itself for versions logged before it (the `pytorch` flavour)."""
    if "pytorch" in mlflow.models.get_model_info(model_uri).flavors:
        return mlflow.pytorch.load_model(model_uri, map_location="cpu")
    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().dlrm.cpu()


def champion_ne(config: PipelineConfig, champion: ModelVersion) -> float | None:
    """The champion's NE on this run's eval days, with its own preprocessing state."""
    try:
        state = logged_state(config.tracking_uri, champion.run_id)
    except MlflowException:
        return None  # a champion without its preprocessing state cannot score new days
    mlflow.set_tracking_uri(config.tracking_uri)
    try:
        model = registered_dlrm(f"models:/{config.tracking.registered_model}/{champion.version}")
    except Exception as error:  # noqa: BLE001 - e.g. a version pickled with classes this release no longer has
        get_run_logger().warning("champion version %s cannot be loaded (%s): it cannot be compared, so nothing "
                                 "is promoted; set the alias by hand to move on", champion.version, error)  # fmt: skip
        return None
    warehouse, features_root = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    parts = []
    for day in config.data.eval_days:
        folder = apply_state(config.preprocess, state, warehouse, features_root, day)
        files = [str(p) for p in sorted(folder.glob("*.parquet"))]
        parts.append(score_files(dlrm_logits(model), files, config.evaluation.slice_feature))
    joined = Scores.concat(parts)
    return compute_ne(binary_state(joined.labels, joined.predictions))
