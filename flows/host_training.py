"""`dlrm train`: only the training stage, on features a run folder already holds; on one
host, or as one host's part of a multi-host job (one command per host, same shared folder).

The data stages run once (`dlrm run` or `dlrm preprocess`) into a folder every host mounts;
each host then trains its ranks from the same feature files and writes its checkpoint
shards into the same checkpoint folder. Node 0 reports: the summary, and the trained
model's NE on the config's evaluation days from every rank's predictions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evaluation.metrics import binary_state, compute_ne
from evaluation.report import Scores
from flows.config import ConfigError, PipelineConfig
from flows.features import with_run_length
from flows.tasks import build_job, read_predictions
from ingestion.preprocess import PreprocessState, features_dir, state_id_for
from training.hosts import HostRole
from training.launcher import launch
from training.summary import TrainSummary


def prepared_features(config: PipelineConfig) -> tuple[PreprocessState, dict[int, list[str]]]:
    """The fitted state and feature files of the config's days, as `dlrm preprocess` left them."""
    warehouse, root = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    again = "run `dlrm preprocess --config …` (or `dlrm run`) with this config on the shared run folder first"
    try:
        state_id = state_id_for(config.preprocess, warehouse, config.data.train_days)
    except (OSError, ValueError) as error:
        raise ConfigError(f"no warehouse for the training days under {warehouse} ({error}): {again}") from None
    state_path = root / state_id / "state.json"
    if not state_path.is_file():
        raise ConfigError(f"no preprocessing state {state_id} for days {list(config.data.train_days)} "
                          f"in {root}: {again}")  # fmt: skip
    state = PreprocessState.load(state_path)
    files = {}
    for day in config.data.all_days:
        folder = features_dir(root, state, day)
        if not (folder / "_done.json").is_file():
            raise ConfigError(f"no features of day {day} in {folder}: {again}")
        files[day] = [str(path) for path in sorted(folder.glob("*.parquet"))]
    return state, files


def train_on_this_host(config: PipelineConfig, role: HostRole, out: Path | None,
                       say: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Train this host's ranks of the job; node 0 returns the job's report, others their part."""
    state, files = prepared_features(config)
    config = with_run_length(config, state, role.nnodes)
    world = role.nnodes * config.training.nproc
    if config.training.batch_size % world:
        raise ConfigError(f"training.batch_size: {config.training.batch_size} is not a multiple of the world size "
                          f"{world} ({role.nnodes} hosts × {config.training.nproc} processes)")  # fmt: skip
    job = build_job(config, state, files)
    if out is not None:
        job = dataclasses.replace(job, out_dir=str(out))
    role = role.resolved() if role.nnodes > 1 else role
    if role.nnodes > 1:
        say(f"[train] node {role.node_rank} of {role.nnodes}: rendezvous at {role.endpoint}, this host as "
            f"{role.local_addr} on {role.socket_ifname}; writing into {job.out}")  # fmt: skip
    launch(job, on_line=say, role=role if role.nnodes > 1 else None)
    if not role.leads:
        return {"node_rank": role.node_rank, "nnodes": role.nnodes, "out_dir": str(job.out),
                "report": "node 0 prints the job's summary"}  # fmt: skip
    return job_report(config, TrainSummary.load(job.out / "summary.json"), job.out)


def job_report(config: PipelineConfig, summary: TrainSummary, out: Path) -> dict[str, Any]:
    """What `dlrm train --json` prints (and `dlrm run --json` shares)."""
    scores = Scores.concat([read_predictions(out / "predictions" / f"day={day}") for day in config.data.eval_days])
    return {
        "world_size": summary.world_size,
        "global_batch_size": config.training.batch_size,
        "steps": summary.steps,
        "rows_trained": summary.rows_trained,
        "samples_per_s": summary.samples_per_s,
        "eval_ne": compute_ne(binary_state(scores.labels, scores.predictions)),
        "eval_days": list(config.data.eval_days),
        "resumed_from_step": summary.resumed_from_step,
        "device": summary.device,
        "checkpoint": summary.checkpoint,
        "out_dir": str(out),
    }
