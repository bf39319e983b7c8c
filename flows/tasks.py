"""Prefect tasks: each one calls library code of one package and returns plain results."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evaluation.metrics import BinaryState, binary_state, compute_ne, summarize
from flows.config import PipelineConfig
from ingestion.preprocess import PreprocessState, apply_state, fit_state
from ingestion.synthetic import GroundTruth, existing_day, generate_day, read_day_stats
from ingestion.warehouse import ingest_day
from training.export import export_model
from training.job import TrainJob
from training.launcher import launch

# Work is skipped by the stages' own manifests (a day already ingested, features already
# written for this preprocessing state), which stay right when files change underneath;
# Prefect's input-hash cache would not.
STAGE = {"cache_policy": NO_CACHE}


@task(name="generate-day", **STAGE)
def generate_task(config: PipelineConfig, day: int) -> dict[str, Any]:
    raw = config.path(config.data.raw_dir)
    existing = existing_day(config.data.synthetic, raw, day)
    if existing:
        get_run_logger().info("day %d: generated earlier with the same settings, reusing it", day)
        return asdict(existing)
    stats = generate_day(config.data.synthetic, day, raw, GroundTruth(config.data.synthetic))
    get_run_logger().info("day %d: generated %s rows, Bayes-optimal NE %.4f", day, f"{stats.rows:,}", stats.bayes_ne)
    return asdict(stats)


@task(name="ingest-day", retries=2, retry_delay_seconds=5, **STAGE)
def ingest_task(config: PipelineConfig, day: int, sources: list[str]) -> dict[str, Any]:
    report = ingest_day(sources, day, config.path(config.data.warehouse_dir))
    logger = get_run_logger()
    for failed in report.files_failed:
        logger.error("%s", failed.error)
    logger.info(
        "day %d: %s rows read, %s written, %s quarantined%s",
        day, f"{report.rows_read:,}", f"{report.rows_written:,}", f"{report.rows_quarantined:,}",
        " (already ingested, skipped)" if report.skipped else "",
    )  # fmt: skip
    return {
        "day": day,
        "rows_read": report.rows_read,
        "rows_written": report.rows_written,
        "rows_quarantined": report.rows_quarantined,
        "files_failed": [f.error for f in report.files_failed],
        "skipped": report.skipped,
    }


@task(name="fit-preprocessing", **STAGE)
def fit_task(config: PipelineConfig) -> PreprocessState:
    return fit_state(
        config.preprocess,
        config.path(config.data.warehouse_dir),
        config.path(config.preprocess.features_dir),
        config.data.train_days,
    )


@task(name="preprocess-day", **STAGE)
def preprocess_task(config: PipelineConfig, state: PreprocessState, day: int) -> list[str]:
    folder = apply_state(
        config.preprocess, state, config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir), day
    )
    return [str(p) for p in sorted(folder.glob("*.parquet"))]


@task(name="train", **STAGE)
def train_task(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]]) -> dict[str, Any]:
    """Sharded training with torchrun; returns the job's summary (and where its outputs are)."""
    job = build_job(config, state, files)
    logger = get_run_logger()
    launch(job, on_line=logger.info)
    summary = json.loads((job.out / "summary.json").read_text())
    return {**summary, "out_dir": str(job.out)}


def build_job(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]]) -> TrainJob:
    return TrainJob(
        model=config.model,
        sharding=config.sharding,
        training=config.training,
        evaluation=config.evaluation,
        table_sizes=state.table_sizes,
        train_files=tuple(f for day in config.data.train_days for f in files[day]),
        eval_files=tuple(f for day in config.data.eval_days for f in files[day]),
        out_dir=str(config.path("train")),
    )


@task(name="evaluate", **STAGE)
def evaluate_task(config: PipelineConfig, state: PreprocessState, train_out: str) -> dict[str, float]:
    """NE, AUC, calibration, log loss on the held-out days, beside two reference points."""
    table = pq.read_table(Path(train_out) / "predictions")
    labels = table["label"].to_numpy().astype(np.float64)
    predictions = table["prediction"].to_numpy().astype(np.float64)
    metrics = {f"eval_{k}": v for k, v in summarize(labels, predictions).items()}
    # The constant predictor: every example gets the training days' click rate.
    constant = binary_state(labels, np.full_like(labels, state.train_click_rate))
    metrics["baseline_constant_ne"] = compute_ne(constant)
    bayes = _bayes_ne(config)
    if bayes is not None:
        metrics["bayes_ne"] = bayes
        metrics["ne_gap_to_bayes_pct"] = 100.0 * (metrics["eval_ne"] - bayes) / bayes
    get_run_logger().info(
        "eval days %s: NE %.4f  AUC %.4f  calibration %.3f  (Bayes-optimal NE %s)",
        list(config.data.eval_days), metrics["eval_ne"], metrics["eval_auc"], metrics["eval_calibration"],
        f"{bayes:.4f}" if bayes is not None else "n/a",
    )  # fmt: skip
    return metrics


def _bayes_ne(config: PipelineConfig) -> float | None:
    """The generator's Bayes-optimal NE over the eval days (generated data only)."""
    if config.data.source != "synthetic":
        return None
    raw = config.path(config.data.raw_dir)
    stats = [read_day_stats(raw, day) for day in config.data.eval_days]
    if any(s is None for s in stats):
        return None
    # NE of the union: summed log loss over summed entropy normaliser.
    state = BinaryState(
        count=sum(s.rows for s in stats),
        label_sum=sum(s.clicks for s in stats),
        cross_entropy_sum=sum(s.bayes_log_loss * s.rows for s in stats),
    )
    return compute_ne(state)


@task(name="export-model", **STAGE)
def export_task(config: PipelineConfig, state: PreprocessState, files: dict[int, list[str]], checkpoint: str):
    return export_model(build_job(config, state, files), Path(checkpoint))
