"""The training loop over a sharded model (any world size, any device).

    for each step: the scheduled rates → one step (forward, backward, optimizer) → the row
    ledger → the training NE → a held-out NE when due → a checkpoint when due

Its parts live in `training/loop/`: the batches, the step (plain or TorchRec's
sparse-dist pipeline), the meters, the held-out scoring and the checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.optim.keyed import CombinedOptimizer

from training.job import TrainJob
from training.loop.admission import AdmissionLedger, maybe_admit
from training.loop.batches import TrainBatches
from training.loop.checkpoint import RowLedger, TrainPosition, save_checkpoint
from training.loop.heldout import heldout_state
from training.loop.meters import TrainingNE, TrainTimer
from training.loop.profile import StepProfile, StepProfiler
from training.loop.progress import Progress
from training.loop.schedule import LRSchedule
from training.loop.steps import StepOutput, TrainSteps, train_steps
from training.loop.validation import EpochValidation


@dataclass(frozen=True)
class TrainStats:
    steps: int  # the step training ended at (counting steps before a resume)
    samples: int  # samples trained by this launch after its first step
    seconds: float  # their training time (evaluations and checkpoints excluded)
    first_step_seconds: float  # compilation, allocation and cache warm-up happen here
    ledger: RowLedger
    position: TrainPosition
    profile: StepProfile | None = None  # only when the job profiles steps (`profile_steps`)
    admissions: AdmissionLedger | None = None  # managed ids' rounds (None: not managed)
    validation: EpochValidation | None = None  # a run that chose its length (`epochs = "auto"`)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def train(
    model: nn.Module,
    optimizer: CombinedOptimizer,
    job: TrainJob,
    device: torch.device,
    schedule: LRSchedule,
    start: TrainPosition | None = None,
    ledger: RowLedger | None = None,
    started_from_model: bool = False,
) -> TrainStats:
    """Epochs over the training files from `start`; every rank takes the same steps.

    Checkpoints every `checkpoint_every` steps; returns when the last epoch is done, or, in
    a run that chooses its length, when validation stops it (with the best epoch's model).
    `started_from_model`: the weights before the first step are a model worth keeping (a
    warm start, or a wide part started as the fitted regression): such a run scores them
    first, and keeps them if no epoch beats them.
    """
    config = job.training
    resumed = start is not None
    start = start or TrainPosition(step=0, epoch=0, batch=0)
    ledger = ledger or RowLedger()
    batches = TrainBatches(job, device, start)
    total_steps = batches.steps_per_epoch * job.most_epochs
    if job.max_steps:
        total_steps = min(total_steps, job.max_steps)
    metrics = job.folder.metrics if dist.get_rank() == 0 else None
    progress = Progress(total_steps, batches.steps_per_epoch, config.batch_size, job.evaluation.ne_window, metrics)
    ne = TrainingNE(progress, device, config.log_every)
    model.train()
    steps = train_steps(model, optimizer, config, device, job.managed_ids is not None, dist.get_world_size())
    timer = TrainTimer(start.step, total_steps, device)
    profiler = StepProfiler(job.profile_steps, total_steps, device)
    stream = profiler.labelled(batches.stream) if profiler.active else batches.stream
    step = start.step
    admissions = AdmissionLedger()
    validation = EpochValidation(job, device, resumed) if job.chooses_epochs else None
    if validation is not None and step == 0 and started_from_model:
        validation.score(steps.pause(), optimizer, 0, 0, ledger)  # the model the run continues
        model.train()
    # a relaunch after validation had stopped the run (during its refit) trains no more
    finished = validation is not None and resumed and validation.scores.done()
    while step < total_steps and not finished:
        loss, logits, labels = train_step(steps, stream, batches, schedule, ledger, step, total_steps)
        step += 1
        if job.managed_ids is not None:
            maybe_admit(model, job.managed_ids.eviction_interval, config.checkpoint_every, config.seed, admissions,
                        step, total_steps)  # fmt: skip
        timer.stepped(step)
        profiler.stepped(step)
        ne.add(logits, labels)
        maybe_evaluate(steps, job, device, progress, timer, step, ne)
        ne.maybe_log(step, loss)
        maybe_checkpoint(model, optimizer, job, batches, ledger, timer, step, total_steps, ne)
        if validation is not None and step % batches.steps_per_epoch == 0:
            with timer.paused():
                ne.flush()
                stop = validation.score(steps.pause(), optimizer, step // batches.steps_per_epoch, step, ledger)
                model.train()
            if stop:
                break
    if admissions.rounds and dist.get_rank() == 0:
        print(f"[train] managed ids: {admissions.rounds} admission rounds; rows restarted for new ids: "
              f"{sum(admissions.restarted_rows.values()):,}", flush=True)  # fmt: skip
    steps.pause()  # the model's own forward again, for the final checkpoint and predictions
    batches.close()
    progress.close()
    samples, seconds = timer.timed_steps(step) * config.batch_size, timer.seconds()
    position = TrainPosition(step, -(-step // batches.steps_per_epoch), 0)
    if validation is not None and (best := validation.restore_best(model, optimizer)) is not None:
        position, ledger = best
        if dist.get_rank() == 0:
            print(f"[train] keeping the model of epoch {position.epoch} (step {position.step}): "
                  f"{validation.scores.reason()}", flush=True)  # fmt: skip
    return TrainStats(steps=position.step, samples=samples, seconds=seconds,
                      first_step_seconds=timer.first_step_seconds, ledger=ledger, position=position,
                      profile=profiler.result() if profiler.active else None,
                      admissions=admissions if job.managed_ids is not None else None,
                      validation=validation)  # fmt: skip


def train_step(steps: TrainSteps, stream: Iterator[Batch], batches: TrainBatches, schedule: LRSchedule,
               ledger: RowLedger, step: int, total_steps: int) -> StepOutput:  # fmt: skip
    """Train step `step + 1` on the next batch of `stream` (`batches`' own, or labelled for
    the profiler) at its scheduled rates, and account the batch it trained."""
    schedule.apply(step, total_steps)
    output = steps.step(stream)
    trained = batches.pop_trained()
    ledger.add(trained.rows, trained.hash_sum)
    return output


def maybe_evaluate(steps: TrainSteps, job: TrainJob, device: torch.device, progress: Progress, timer: TrainTimer,
                   step: int, ne: TrainingNE) -> None:  # fmt: skip
    """Held-out NE every `heldout_every_steps` steps, at every epoch end when
    `heldout_every_epoch`, and at the last step of either (not training time)."""
    every, config = job.evaluation.heldout_every_steps, job.evaluation
    periodic = bool(every) and (step % every == 0 or step == progress.total_steps)
    if periodic or (config.heldout_every_epoch and step % progress.steps_per_epoch == 0):
        with timer.paused():
            ne.flush()  # the training records before this one, in step order
            progress.add_heldout(step, heldout_state(steps.pause(), job, device))


def maybe_checkpoint(model: nn.Module, optimizer: CombinedOptimizer, job: TrainJob, batches: TrainBatches,
                     ledger: RowLedger, timer: TrainTimer, step: int, total_steps: int, ne: TrainingNE) -> None:  # fmt: skip
    """A checkpoint every `checkpoint_every` steps before the last (the worker writes the
    last), at the position after the batch this step trained (not training time)."""
    every = job.training.checkpoint_every
    if every and step % every == 0 and step < total_steps:
        with timer.paused():
            ne.flush()  # every record up to the step a resume starts from is written
            save_checkpoint(model, optimizer, job.checkpoint_root, batches.position(step),
                            ledger, job.training.keep_checkpoints, job.training.delta_every)  # fmt: skip
