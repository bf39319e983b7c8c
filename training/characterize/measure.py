"""One point of a hardware characterization: a real, short training job of a model at one
setting, and what it measured.

A point's job trains `warmup` windows, then `windows` timed windows, then `profile_steps`
profiled steps (training/loop/profile.py), over generated rows (again, if it needs more). Its throughput is
the median of the timed windows' samples/s (each window ends where the loop has waited for
the device: the logged step all-reduces the NE sums), with their spread; its step time is
split by the profiled steps; its peak memory is each rank's; and the planner's estimate is
asked for the same model, plan and per-rank batch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from evaluation.config import EvaluationConfig
from training.config import ModelConfig, ShardingConfig, TrainingConfig, Workers
from training.job import TrainJob
from training.launch.launcher import TrainingFailed, launch
from training.loop.optimizers import attach_embedding_optimizer
from training.loop.profile import PARTS
from training.loop.progress import TrainRecord, read_records
from training.model.build import build_train_model, table_name
from training.sharding.plan import ShardingError, cluster_topology, plan_sharding, this_job_cluster


@dataclass(frozen=True)
class Windows:
    """How a point's job is timed: whole windows of at least `min_window_samples` samples."""

    warmup: int = 1  # windows before the timed ones (allocation, caches, kernel choice)
    windows: int = 5
    min_window_samples: int = 16_384
    min_window_steps: int = 4
    profile_steps: int = 5

    def steps_per_window(self, global_batch: int) -> int:
        return max(self.min_window_steps, math.ceil(self.min_window_samples / global_batch))

    def total_steps(self, global_batch: int) -> int:
        return (self.warmup + self.windows) * self.steps_per_window(global_batch) + self.profile_steps

    def rows_needed(self, global_batch: int) -> int:
        return self.total_steps(global_batch) * global_batch


@dataclass(frozen=True)
class PointSetup:
    """A model at one setting, and the rows it trains on (generated to the model's shape)."""

    values: dict[str, Any]  # the swept keys and their values here (the batch included)
    model: ModelConfig
    sharding: ShardingConfig
    training: TrainingConfig
    table_sizes: dict[str, int]
    files: tuple[str, ...]
    rows: int  # in `files`: a job needing more reads them again (another epoch)
    dense_features: int = 13
    pooling_factors: dict[str, float] = field(default_factory=dict)

    @property
    def workers(self) -> Workers:
        return Workers(self.training.nproc, 1)


@dataclass(frozen=True)
class MeasuredPoint:
    values: dict[str, Any]
    batch_size: int  # global
    samples_per_s: float  # median of the timed windows
    samples_per_s_min: float
    samples_per_s_max: float
    windows: int
    peak_memory_mb: float  # the largest rank's
    peak_memory_mb_per_rank: list[float]
    measured_step_ms: float  # batch / median samples/s
    estimated_step_ms: float  # the planner's cost of the busiest rank (embeddings and their communication)
    breakdown_ms: dict[str, float]  # per step: data, embedding, dense, communication, optimizer, other
    profiled_step_ms: float  # the profiled steps' wall time (the profiler's cost included): the parts' total
    breakdown_timing: str  # "device" or "cpu" (training/loop/profile.py)
    device: str  # "cpu" or "cuda"
    world_size: int

    @property
    def spread(self) -> float:
        """The windows' range as a share of the median."""
        return (self.samples_per_s_max - self.samples_per_s_min) / self.samples_per_s if self.samples_per_s else 0.0

    @property
    def measured_embedding_ms(self) -> float:
        """What the planner's estimate covers: the lookups and their communication."""
        return self.breakdown_ms.get("embedding", 0.0) + self.breakdown_ms.get("communication", 0.0)


@dataclass(frozen=True)
class SkippedPoint:
    values: dict[str, Any]
    batch_size: int
    reason: str  # one line
    out_of_memory: bool = False


PointResult = MeasuredPoint | SkippedPoint


def estimated_step_ms(setup: PointSetup, device: torch.device) -> float:
    """The planner's cost for this point (ms per step on the busiest rank), planned on the
    meta device over this host's topology, as the job's own workers plan it."""
    model = build_train_model(setup.model, setup.table_sizes, torch.device("meta"), setup.dense_features)
    attach_embedding_optimizer(model, setup.training)
    workers = setup.workers
    topology = cluster_topology(this_job_cluster(device, workers.world_size, setup.training.nproc))
    pooling = {table_name(f): factor for f, factor in setup.pooling_factors.items()}
    _, estimates = plan_sharding(model, setup.sharding, topology, workers.per_rank_batch(setup.training.batch_size),
                                 pooling_factor=pooling or 1.0)  # fmt: skip
    return max((e.perf_ms for e in estimates), default=0.0)


def point_job(setup: PointSetup, windows: Windows, out_dir: Path) -> TrainJob:
    batch = setup.training.batch_size
    epochs = math.ceil(windows.rows_needed(batch) / max(1, setup.rows)) + 1  # padded epoch ends: one to spare
    training = replace(setup.training, epochs=epochs, log_every=windows.steps_per_window(batch), checkpoint_every=0,
                       max_restarts=0, warmup_steps=0, warmup_fraction=0.0, lr_decay="none")  # fmt: skip
    return TrainJob(
        model=setup.model, sharding=setup.sharding, training=training,
        evaluation=EvaluationConfig(heldout_every_steps=0, heldout_every_epoch=False),
        table_sizes=dict(setup.table_sizes), train_files=setup.files, eval_files={}, out_dir=str(out_dir),
        dense_features=setup.dense_features, pooling_factors=dict(setup.pooling_factors),
        profile_steps=windows.profile_steps, max_steps=windows.total_steps(batch), run_id=f"characterize-{batch}",
    )  # fmt: skip


def measure_point(setup: PointSetup, windows: Windows, out_dir: Path, device: torch.device,
                  on_line=lambda line: None) -> PointResult:  # fmt: skip
    """Train the point's job and read what it measured; a point the device cannot run (a
    placement it lacks, memory it has not) is skipped with the reason in one line."""
    batch = setup.training.batch_size
    try:
        setup.workers.per_rank_batch(batch)
        estimate = estimated_step_ms(setup, device)
    except (ValueError, ShardingError) as error:
        return SkippedPoint(setup.values, batch, str(error))
    job = point_job(setup, windows, out_dir)
    try:
        launch(job, on_line=on_line)
    except TrainingFailed as failed:
        text = str(failed)
        memory = "out of memory" in text.lower() or "outofmemory" in text.lower() or failed.exit_code in (-9, 137)
        return SkippedPoint(setup.values, batch, _one_line(text), out_of_memory=memory)
    return read_point(job, setup.values, windows, estimate)


def read_point(job: TrainJob, values: dict[str, Any], windows: Windows, estimate_ms: float) -> MeasuredPoint:
    """The figures of a finished point's job (its metrics records, summary and profile)."""
    batch = job.training.batch_size
    per_window = windows.steps_per_window(batch)
    timed_from, timed_to = windows.warmup * per_window, (windows.warmup + windows.windows) * per_window
    rates = [r.samples_per_s for r in read_records(job.folder.metrics)
             if isinstance(r, TrainRecord) and timed_from < r.step <= timed_to]  # fmt: skip
    if not rates:
        raise RuntimeError(f"{job.out_dir}: no timed window was logged (steps {timed_from + 1}–{timed_to})")
    summary = job.folder.read_summary()
    profile = job.folder.read_profile()
    median = statistics.median(rates)
    breakdown = {part: 0.0 for part in (*PARTS, "other")} if profile is None else profile.parts_ms()
    peaks = profile.peak_memory_mb if profile is not None else []
    return MeasuredPoint(
        values=values, batch_size=batch, samples_per_s=round(median, 1), samples_per_s_min=round(min(rates), 1),
        samples_per_s_max=round(max(rates), 1), windows=len(rates), peak_memory_mb=max(peaks, default=0.0),
        peak_memory_mb_per_rank=peaks, measured_step_ms=round(batch / median * 1000, 4),
        estimated_step_ms=round(estimate_ms, 4), breakdown_ms=breakdown,
        profiled_step_ms=profile.wall_ms if profile is not None else 0.0,
        breakdown_timing=profile.timing if profile is not None else "none", device=summary.device,
        world_size=summary.world_size,
    )  # fmt: skip


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split()) or "the job failed"
    return line if len(line) <= limit else line[: limit - 1] + "…"
