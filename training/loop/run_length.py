"""How many optimizer steps a run takes, and a batch size that gives it enough of them.

Small data at a large default batch trains a handful of steps: 8,000 rows at batch 2,048
is 4 steps, after which a DLRM is still worse than predicting the click rate. A run's
global batch is therefore halved until the run has at least `training.min_steps` steps
(never below 32 rows per process), and the change is said; a run that still has fewer
steps than that is warned about with what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ingestion.reader import batches_per_rank
from training.config import TrainingConfig, Workers

SMALLEST_PER_PROCESS = 32


@dataclass(frozen=True)
class RunLength:
    training: TrainingConfig  # with the batch size the run trains at
    steps: int
    note: str | None  # what was changed, or what to change, for the log; None: nothing to say


def steps_of(rows: int, batch_size: int, workers: Workers, epochs: int) -> int:
    """Optimizer steps over `rows` training rows: the reader's batches per rank, each epoch."""
    return batches_per_rank(rows, workers.per_rank_batch(batch_size), workers.world_size) * epochs if rows else 0


def fit_run_length(training: TrainingConfig, rows: int, workers: Workers) -> RunLength:
    """`training` with its batch halved until the run has `min_steps` steps (see module)."""
    world_size = workers.world_size
    steps = steps_of(rows, training.batch_size, workers, training.epochs)
    wanted = training.min_steps
    if not wanted or steps >= wanted:
        return RunLength(training, steps, None)
    batch, floor = training.batch_size, SMALLEST_PER_PROCESS * world_size
    while steps < wanted and batch // 2 >= floor and (batch // 2) % world_size == 0:
        batch //= 2
        steps = steps_of(rows, batch, workers, training.epochs)
    if batch == training.batch_size:
        return RunLength(training, steps, _few_steps(steps, rows, training))
    note = (f"training.batch_size {training.batch_size:,} would train {steps_of(rows, training.batch_size, workers, training.epochs)} "
            f"steps on {rows:,} rows (fewer than training.min_steps = {wanted}): training at batch {batch:,} "
            f"({steps} steps); set training.batch_size, or training.min_steps = 0 to keep it")  # fmt: skip
    if steps < wanted:
        note += "; " + _few_steps(steps, rows, training)
    return RunLength(dataclasses.replace(training, batch_size=batch), steps, note)


def _few_steps(steps: int, rows: int, training: TrainingConfig) -> str:
    return (f"only {steps} optimizer steps ({rows:,} rows, batch {training.batch_size:,}, {training.epochs} "
            f"epoch(s)): a model this briefly trained is often worse than the click rate; lower "
            f"training.batch_size or raise training.epochs")  # fmt: skip
