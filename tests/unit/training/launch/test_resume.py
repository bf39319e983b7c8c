"""Which checkpoints a job resumes from: its fingerprint, the finished mark, the reason a
changed job starts fresh, and the retention of run folders."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.config import EvaluationConfig
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.resume import FINISHED, job_fingerprint, mark_finished, prepare_checkpoints


def _job(tmp_path: Path, **training: object) -> TrainJob:
    data = tmp_path / "day0.parquet"
    if not data.exists():
        pq.write_table(pa.table({"label": [0, 1, 0]}), data)
    job = TrainJob(
        model=ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)),
        sharding=ShardingConfig(),
        training=TrainingConfig(**{"nproc": 2, "batch_size": 256, **training}),
        evaluation=EvaluationConfig(),
        table_sizes={"C1": 10},
        train_files=(str(data),),
        eval_files={},
        out_dir=str(tmp_path / "train"),
    )
    return dataclasses.replace(job, run_id=job_fingerprint(job))


def _fake_checkpoint(job: TrainJob, step: int) -> None:
    folder = job.checkpoint_root / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"position": {"step": step}, "world_size": 2}))


def test_the_fingerprint_covers_what_is_learned_not_how_often_it_is_saved(tmp_path: Path) -> None:
    base = job_fingerprint(_job(tmp_path))
    assert job_fingerprint(_job(tmp_path)) == base
    assert job_fingerprint(_job(tmp_path, checkpoint_every=7, max_restarts=3)) == base
    assert job_fingerprint(_job(tmp_path, checkpoint_mode="delta", full_checkpoint_every=3)) == base
    assert job_fingerprint(_job(tmp_path, embedding_lr=0.2)) != base
    pq.write_table(pa.table({"label": [1, 1, 0, 1]}), tmp_path / "day0.parquet")  # the data changed
    assert job_fingerprint(_job(tmp_path)) != base


def test_an_interrupted_job_resumes_and_a_finished_one_trains_again(tmp_path: Path) -> None:
    job = _job(tmp_path)
    assert prepare_checkpoints(job) == "starting at step 0"
    _fake_checkpoint(job, 20)
    assert prepare_checkpoints(job).startswith("resuming the interrupted run from step-20")
    mark_finished(job)
    assert "training again from step 0" in prepare_checkpoints(job)
    assert not list(job.checkpoint_root.glob("step-*")) and not (job.checkpoint_root / FINISHED).exists()


def test_a_changed_setting_starts_fresh_and_names_the_change(tmp_path: Path) -> None:
    before = _job(tmp_path)
    prepare_checkpoints(before)
    _fake_checkpoint(before, 40)
    changed = _job(tmp_path, embedding_lr=0.2)
    reason = prepare_checkpoints(changed)
    assert reason.startswith("starting at step 0, not resuming the interrupted run in")
    assert "training.embedding_lr 0.05 → 0.2" in reason


def test_run_folders_beyond_keep_checkpoints_are_removed_oldest_first(tmp_path: Path) -> None:
    jobs = [_job(tmp_path, seed=seed, keep_checkpoints=2) for seed in range(3)]
    for job in jobs:
        prepare_checkpoints(job)
    kept = sorted(p.name for p in (tmp_path / "train" / "checkpoints").iterdir())
    assert kept == sorted(job.run_id for job in jobs[1:])
