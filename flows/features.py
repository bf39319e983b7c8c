"""Raw days to feature files: the `ingest` (generate, for the synthetic source, then
validate into the warehouse) and `preprocess` (DuckDB) subflows.

Shared by the `pipeline`, `retrain` and `retune` flows. Each stage skips a day whose
inputs did not change (by its manifest) and logs that it did, so a second flow on the
same days does no work. Days fan out over a thread pool of `orchestration.max_workers`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect import flow, get_run_logger
from prefect.exceptions import MissingContextError
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import ConfigError, PipelineConfig
from flows.sources import raw_sources
from flows.stopped_runs import cancel_when_stopped
from flows.tasks import fit_task, generate_task, ingest_task, preprocess_task
from ingestion.preprocess import PreprocessState
from training.run_length import fit_run_length


class IngestError(RuntimeError):
    """No readable rows for a day the run needs."""


@dataclass(frozen=True)
class Features:
    state: PreprocessState
    files: dict[int, list[str]]  # day → feature files
    ingest: list[dict[str, Any]]  # one ingest report per day


def prepare_features(config: PipelineConfig, parent: PreprocessState | None = None) -> Features:
    """Ingest and preprocess the config's days; `parent`: the preprocessing state of the
    model this run continues, extended instead of fitting a new one."""
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    days = list(config.data.all_days)
    runner = {"task_runner": day_task_runner(config)}
    ingest = ingest_days.with_options(**runner)(config, days)
    state, files = preprocess_days.with_options(**runner)(config, days, parent)
    return Features(state, files, ingest)


def day_task_runner(config: PipelineConfig):
    """Where the per-day tasks run: a local thread pool, or a Dask cluster."""
    if config.orchestration.task_runner == "dask":
        from prefect_dask import DaskTaskRunner

        check_workers_reach_prefect(config.orchestration.dask_address)
        return DaskTaskRunner(address=config.orchestration.dask_address)
    return ThreadPoolTaskRunner(max_workers=config.orchestration.max_workers)


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
def ingest_days(config: PipelineConfig, days: list[int]) -> list[dict[str, Any]]:
    """Raw files of each day → the validated Parquet warehouse (generated first for the
    synthetic source); one report per day."""
    sources = raw_sources(config)
    if config.data.source == "synthetic":
        generate_task.map(config, days).result()
    ingest = ingest_task.map(config, days, [sources[d] for d in days]).result()
    _require_ingested(ingest)
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


def _require_ingested(ingest: list[dict[str, Any]]) -> None:
    empty = [r["day"] for r in ingest if r["rows_written"] == 0 and not r["skipped"]]
    if empty:
        errors = "; ".join(e for r in ingest for e in r["files_failed"]) or "no valid rows"
        raise IngestError(f"day(s) {empty} have no ingested rows: {errors}")


def with_run_length(config: PipelineConfig, state: PreprocessState, hosts: int | None = None) -> PipelineConfig:
    """The config at a batch size that gives the run `training.min_steps` steps on its
    training rows (training/run_length.py); the change, or a warning, goes to the log.
    Applied before the tuning key is taken, so the key names the batch the run trains at.
    `hosts`: the job's hosts (default: the pipeline's, `orchestration.trainer_hosts`)."""
    world = config.training.nproc * (hosts or config.orchestration.trainer_hosts)
    fitted = fit_run_length(config.training, state.train_rows, world)
    if fitted.note:
        run_logger("flows.features").warning("%s", fitted.note)
    return dataclasses.replace(config, training=fitted.training)


def run_logger(fallback: str) -> logging.Logger | logging.LoggerAdapter:
    """The flow run's logger inside Prefect; the standard logger `fallback` outside (benchmarks)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)
