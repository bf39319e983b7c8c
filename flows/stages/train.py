"""The training stage: a resolved run's job, trained on this host or on every trainer host,
and what it reports.

Several hosts come one way: `orchestration.trainer_hosts` (which `dlrm train --nnodes`
sets). The pipeline's stage then starts each host's part through its served deployment
(flows/stages/train_nodes.py), or, with `orchestration.launcher = "slurm"`, as one Slurm batch
job over that many nodes (flows/stages/train_slurm.py); `dlrm train` is run by hand on each
host. All build the job here (`build_job`), and every host launches its part of the same job
with `launch(job, role)`.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from flows.run.job import TrainedModel, build_job
from flows.run.rows import TrainingRows
from flows.stages import heartbeats
from flows.stages.features import STAGE
from flows.stages.stopped_runs import cancel_when_stopped
from flows.stages.train_nodes import train_on_hosts
from flows.stages.train_slurm import train_on_slurm
from flows.stages.trainer_slots import trainer_slot
from training.job import JobFolder
from training.launch.launcher import launch
from training.loop.progress import MetricsRecord

heartbeats.install()  # this module's flow runs end when their work ends


@flow(name="train", on_crashed=[cancel_when_stopped])
def train_model(config: PipelineConfig, features: Features, warm_start: str = "",
                rows: TrainingRows | None = None) -> TrainedModel:  # fmt: skip
    """Sharded training with torchrun on a resolved run's training days (from `warm_start`'s
    checkpoint when given; `rows`: less the calibration rows); the job's summary and outputs."""
    return train_task(config, features, warm_start, rows)


@task(name="train", retries=1, retry_delay_seconds=2, **STAGE)
def train_task(config: PipelineConfig, features: Features, warm_start: str = "",
               rows: TrainingRows | None = None) -> TrainedModel:  # fmt: skip
    """Sharded training with torchrun; returns the job's summary and where its outputs are.

    A retry of this task, or the same command after an interruption, resumes from the
    job's last checkpoint; a job that ran to its end trains again (training/launch/resume.py).
    `warm_start`: a checkpoint to continue (weights and optimizer state).
    """
    job = build_job(config, features, warm_start, rows=rows)
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, key="training-progress", description="Training steps done (%)")
    shown = [0.0]

    def on_progress(record: MetricsRecord) -> None:
        done = 100.0 * record.step / max(1, record.total_steps)
        if done >= shown[0] + 1:  # at most ~100 updates a run
            shown[0] = done
            update_progress_artifact(progress, done)

    hosts = config.orchestration
    slurm_job_id = ""
    with trainer_slot(config, logger):
        if hosts.launcher == "slurm":
            slurm_job_id = train_on_slurm(job, hosts.slurm, config.name, config.path("slurm"), logger.info,
                                          on_progress=on_progress)
        elif hosts.trainer_hosts > 1:
            train_on_hosts(job, hosts.rdzv_endpoint, logger.info)
        else:
            launch(job, on_line=logger.info, on_progress=on_progress)
    update_progress_artifact(progress, 100.0)
    _publish_plan(job.folder)
    return TrainedModel(job.folder.read_summary(), job.folder, slurm_job_id)


def _publish_plan(folder: JobFolder) -> None:
    """The sharding plan as a Prefect table: table → sharding type → ranks → bytes per rank."""
    rows = [
        {"table": row["table"], "sharding_type": row["sharding_type"], "compute_kernel": row["compute_kernel"],
         "ranks": ",".join(map(str, row["ranks"])),
         "bytes_per_rank": ", ".join(f"{rank}: {size:,}" for rank, size in row["bytes_per_rank"].items())}
        for row in folder.read_plan()
    ]  # fmt: skip
    if rows:
        create_table_artifact(key="sharding-plan", table=rows, description="Where each embedding table lives")
