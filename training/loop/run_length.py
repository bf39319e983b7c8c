"""How many optimizer steps a run takes, and a batch size that gives it enough of them.

Small data at a large default batch trains a handful of steps: 8,000 rows at batch 2,048
is 4 steps, after which a DLRM is still worse than predicting the click rate. A run's
global batch is therefore halved until the run has at least `training.min_steps` steps
(never below 32 rows per process), and the change is said; a run that still has fewer
steps than that is warned about with what to change. A run that chooses its own length
(`training.epochs = "auto"`) wants those steps in each epoch: it is scored after each one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ingestion.batch_count import batches_per_rank
from training.config import TrainingConfig, Workers

SMALLEST_PER_PROCESS = 32


@dataclass(frozen=True)
class RunLength:
    training: TrainingConfig  # with the batch size the run trains at
    steps: int  # in all its epochs; one epoch's when the run chooses its epochs
    note: str | None  # what was changed, or what to change, for the log; None: nothing to say


def rule_epochs(training: TrainingConfig) -> int:
    """The epochs whose steps the rule counts: one when the run chooses its epochs."""
    return 1 if training.chooses_epochs else int(training.epochs)


def steps_of(rows: int, batch_size: int, workers: Workers, epochs: int) -> int:
    """Optimizer steps over `rows` training rows: the reader's batches per rank, each epoch."""
    return batches_per_rank(rows, workers.per_rank_batch(batch_size), workers.world_size) * epochs if rows else 0


def fit_run_length(training: TrainingConfig, rows: int, workers: Workers) -> RunLength:
    """`training` with its batch halved until the run has `min_steps` steps (see module)."""
    world_size = workers.world_size
    epochs = rule_epochs(training)
    steps = steps_of(rows, training.batch_size, workers, epochs)
    wanted = training.min_steps
    if not wanted or steps >= wanted:
        return RunLength(training, steps, None)
    batch, floor = training.batch_size, SMALLEST_PER_PROCESS * world_size
    while steps < wanted and batch // 2 >= floor and (batch // 2) % world_size == 0:
        batch //= 2
        steps = steps_of(rows, batch, workers, epochs)
    if batch == training.batch_size:
        return RunLength(training, steps, _few_steps(steps, rows, training))
    per = " an epoch" if training.chooses_epochs else ""
    note = (f"training.batch_size {training.batch_size:,} would train {steps_of(rows, training.batch_size, workers, epochs)} "
            f"steps{per} on {rows:,} rows (fewer than training.min_steps = {wanted}): training at batch {batch:,} "
            f"({steps} steps{per}); set training.batch_size, or training.min_steps = 0 to keep it")  # fmt: skip
    if steps < wanted:
        note += "; " + _few_steps(steps, rows, training)
    return RunLength(dataclasses.replace(training, batch_size=batch), steps, note)


def _few_steps(steps: int, rows: int, training: TrainingConfig) -> str:
    epochs = "an epoch" if training.chooses_epochs else f"{training.epochs} epoch(s)"
    return (f"only {steps} optimizer steps ({rows:,} rows, batch {training.batch_size:,}, {epochs}): a model "
            f"this briefly trained is often worse than the click rate; lower training.batch_size or raise "
            f"training.epochs")  # fmt: skip
