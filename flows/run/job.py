"""The training job of a resolved run: the one builder every way into training uses (the
pipeline's stage, `dlrm train` on each host, a trial, characterization), so that the same
config on the same features is the same job, with the same fingerprint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from flows.run.rows import TrainingRows, training_rows
from training.job import JobFolder, TrainJob, TrainSummary
from training.launch.resume import job_fingerprint


@dataclass(frozen=True)
class TrainedModel:
    """A finished training job: its summary, and the folder of its outputs (checkpoints,
    predictions of the eval days, metrics, plan)."""

    summary: TrainSummary
    folder: JobFolder
    slurm_job_id: str = ""  # the Slurm job that trained it (`orchestration.launcher = "slurm"`)


def build_job(config: PipelineConfig, features: Features, warm_start: str = "", run_id: str | None = None,
              rows: TrainingRows | None = None) -> TrainJob:  # fmt: skip
    """The job of the config's training stage. Its checkpoints go to `run_id`'s folder; by
    default, the job's fingerprint, so the same command resumes an interrupted run.
    `warm_start`: start from that checkpoint's weights and optimizer state. `rows`: the
    training days split for calibration; by default the split of a run that continues nothing
    (`training_rows`: the one rule every way into training follows)."""
    state, data = features.state, config.data
    rows = rows or training_rows(config, features)
    job = TrainJob(
        model=config.model,
        sharding=config.sharding,
        training=config.training,
        evaluation=config.evaluation,
        table_sizes=state.model_table_sizes,
        train_files=rows.train_files,
        calibration_files=rows.calibration_files,
        validation_files=(rows.validation_files or rows.calibration_files) if config.training.chooses_epochs else (),
        refit_files=rows.refit_files,
        eval_files={data.day_label(day): tuple(features.files[day]) for day in data.eval_days},
        out_dir=str(config.path("train")),
        run_id=run_id or "",
        hosts=config.orchestration.trainer_hosts,
        pooling_factors=dict(state.multi_hot),
        dense_features=len(state.dense),
        initial_click_rate=state.train_click_rate if config.training.start_at_click_rate else 0.0,
        init_checkpoint=warm_start,
        init_optimizer=bool(warm_start),
        managed_ids=config.preprocess.managed if state.mode == "managed" else None,
        crosses=state.crosses,
        count_bins=state.count_bins,
    )
    return job if run_id else dataclasses.replace(job, run_id=job_fingerprint(job))
