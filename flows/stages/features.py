"""Raw days to feature files: the `ingest` (generate, for the synthetic source, then
validate into the warehouse) and `preprocess` (DuckDB) subflows, and their tasks.

Shared by the `pipeline`, `retrain` and `retune` flows. Each stage skips a day whose
inputs did not change (by its manifest) and logs that it did, so a second flow on the
same days does no work. Days fan out over a thread pool of `orchestration.max_workers`,
or a Dask cluster.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from flows.run.config import ConfigError, PipelineConfig
from flows.run.feature_files import Features
from flows.run.ground_truth import ground_truth
from flows.run.reports import IngestDay
from flows.run.sources import raw_sources
from flows.stages import heartbeats
from flows.stages.stopped_runs import cancel_when_stopped
from ingestion.parquet_source import SchemaChangeError, ingest_parquet_day
from ingestion.preprocess import (
    PreprocessState,
    apply_state,
    continue_state,
    feature_rows,
    fit_state,
)
from ingestion.synthetic import existing_day, generate_day
from ingestion.warehouse import ingest_day

heartbeats.install()  # this module's flow runs end when their work ends

# Work is skipped by the stages' own manifests (a day already ingested, features already
# written for this preprocessing state), which stay right when files change underneath;
# Prefect's input-hash cache would not.
STAGE = {"cache_policy": NO_CACHE}


class IngestError(RuntimeError):
    """No readable rows for a day the run needs."""


def prepare_features(config: PipelineConfig, parent: PreprocessState | None = None) -> Features:
    """Ingest and preprocess the config's days; `parent`: the preprocessing state of the
    model this run continues, extended instead of fitting a new one."""
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    days = list(config.data.all_days)
    ingest = day_flow("ingest", config)(config, days)
    state, files = day_flow("preprocess", config)(config, days, parent)
    return Features(state, files, ingest)


def day_flow(stage: str, config: PipelineConfig):
    """The day flow of `stage` ("ingest" or "preprocess") on the config's task runner, where
    the per-day tasks run: a local thread pool, or a Dask cluster."""
    if config.orchestration.task_runner == "dask":
        check_workers_reach_prefect(config.orchestration.dask_address)
        return _on_runner(stage, config.orchestration.dask_address, 0)
    return _on_runner(stage, None, config.orchestration.max_workers)


@functools.cache
def _on_runner(stage: str, dask_address: str | None, max_workers: int):
    """The day flow of `stage` on the Dask cluster at `dask_address`, else on a thread pool of
    `max_workers`, made once per runner: a flow made anew derives its parameters' JSON schema
    (0.17 s for the config's), and every flow run works on a duplicate of the runner, never on
    this one."""
    if dask_address is not None:
        from prefect_dask import DaskTaskRunner

        runner = DaskTaskRunner(address=dask_address)
    else:
        runner = ThreadPoolTaskRunner(max_workers=max_workers)
    return {"ingest": ingest_days, "preprocess": preprocess_days}[stage].with_options(task_runner=runner)


def check_workers_reach_prefect(dask_address: str) -> None:
    """Dask workers report their task runs to the flow's Prefect API (Prefect hands them its
    address with each task); workers on other hosts cannot reach one on 127.0.0.1."""
    api = str(PREFECT_API_URL.value() or "")
    if not _is_loopback(urlparse(dask_address).hostname) and (not api or _is_loopback(urlparse(api).hostname)):
        raise ConfigError(
            f"orchestration.dask_address: the Dask workers at {dask_address} cannot reach this flow's Prefect API "
            f"({api or 'a temporary server on 127.0.0.1'}): run a Prefect server they can reach (docker-compose's, "
            "or `prefect server start --host 0.0.0.0`) and export PREFECT_API_URL=http://<its address>:4200/api"
        )


def _is_loopback(host: str | None) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host or "")).is_loopback
    except (OSError, ValueError):
        return False


@flow(name="ingest", on_crashed=[cancel_when_stopped])
def ingest_days(config: PipelineConfig, days: list[int]) -> list[IngestDay]:
    """Raw files of each day → the validated Parquet warehouse (generated first for the
    synthetic source); one report per day."""
    sources = raw_sources(config)
    if config.data.source == "synthetic":
        generate_task.map(config, days).result()
    ingest = ingest_task.map(config, days, [sources[d] for d in days]).result()
    _require_ingested(config, ingest)
    return ingest


@flow(name="preprocess", on_crashed=[cancel_when_stopped])
def preprocess_days(
    config: PipelineConfig, days: list[int], parent: PreprocessState | None = None
) -> tuple[PreprocessState, dict[int, list[str]]]:
    """Fit the preprocessing state on the train days (once per config and inputs), or extend
    `parent` with them, then write each day's features; returns the state and each day's
    feature files."""
    state = fit_task(config, parent)
    files = dict(zip(days, preprocess_task.map(config, state, days).result(), strict=True))
    return state, files


def _require_ingested(config: PipelineConfig, ingest: list[IngestDay]) -> None:
    empty = [config.data.shown(r.day) for r in ingest if r.rows_written == 0 and not r.skipped]
    if empty:
        errors = "; ".join(e for r in ingest for e in r.files_failed) or "no valid rows"
        raise IngestError(f"day(s) {empty} have no ingested rows: {errors}")


@task(name="generate-day", **STAGE)
def generate_task(config: PipelineConfig, day: int) -> dict[str, Any]:
    raw = config.path(config.data.raw_dir)
    existing = existing_day(config.data.synthetic, raw, day, config.data.multi_hot)
    if existing:
        get_run_logger().info("day %s: generated earlier with the same settings, reusing it", day)
        return asdict(existing)
    truth = ground_truth(config.data.synthetic, config.data.multi_hot)
    stats = generate_day(config.data.synthetic, day, raw, truth)
    get_run_logger().info("day %s: generated %s rows, Bayes-optimal NE %.4f", day, f"{stats.rows:,}", stats.bayes_ne)
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
def ingest_task(config: PipelineConfig, day: int, sources: list[str]) -> IngestDay:
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
    return IngestDay(
        day=day, rows_read=report.rows_read, rows_written=report.rows_written,
        rows_quarantined=report.rows_quarantined, files_failed=[f.error for f in report.files_failed],
        skipped=report.skipped,
        files=[{"source": f.source, "rows_read": f.rows_read, "rows_written": f.rows_written,
                "rows_quarantined": f.rows_quarantined} for f in report.files if f.error is None],
    )  # fmt: skip


@task(name="fit-preprocessing", **STAGE)
def fit_task(config: PipelineConfig, parent: PreprocessState | None = None) -> PreprocessState:
    """Fit the state on the training days; for a run continuing a model, extend the
    model's own state (`parent`) with them instead."""
    warehouse, features_root = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    days = config.data.train_days
    if parent is not None:
        state = continue_state(config.preprocess, parent, warehouse, features_root, days)
    else:
        state = fit_state(config.preprocess, warehouse, features_root, days)
    get_run_logger().info("preprocessing state %s: days %s, %s rows, click rate %.4f", state.state_id,
                          config.data.shown_days(days), f"{state.train_rows:,}", state.train_click_rate)  # fmt: skip
    return state


@task(name="preprocess-day", **STAGE)
def preprocess_task(config: PipelineConfig, state: PreprocessState, day: int) -> list[str]:
    folder = apply_state(
        config.preprocess, state, config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir), day
    )
    get_run_logger().info("day %s: %s feature rows → %s", config.data.shown(day), f"{feature_rows(folder):,}", folder)
    return [str(p) for p in sorted(folder.glob("*.parquet"))]


def run_logger(fallback: str) -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger inside Prefect; the standard logger `fallback` outside (benchmarks)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)
