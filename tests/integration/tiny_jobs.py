"""The small training job the checkpoint tests share: the tiny days 0–1 to train, day 2 to
score, a DLRM of dim 8 with 32-wide MLPs; the training settings are each test's."""

from __future__ import annotations

from pathlib import Path

from evaluation.config import EvaluationConfig
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob


def tiny_job(features, out: Path, **training) -> TrainJob:
    state, files = features
    return TrainJob(
        model=ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)),
        sharding=ShardingConfig(),
        training=TrainingConfig(**training),
        evaluation=EvaluationConfig(batch_size=1024, ne_window=2048),
        table_sizes=state.table_sizes,
        train_files=tuple(files[0] + files[1]),
        eval_files={"2": tuple(files[2])},
        out_dir=str(out),
        run_id="run-1",
    )
