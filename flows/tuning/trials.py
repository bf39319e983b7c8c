"""One trial of a study: the training runs of a parameter set (one per trial seed) on the
tuning data's training rows, scored by NE on its validation rows (never the evaluation
days); held-out NE during training feeds the pruner and, over several epochs, early
stopping. The flow around the trials: flows/tuning/retune.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna

from evaluation.metrics import MetricError, binary_state, compute_ne
from flows.run.config import ConfigError, PipelineConfig
from flows.run.feature_files import Features
from flows.run.job import build_job
from flows.run.rows import holdout_of
from flows.stages.train_slurm import train_where_configured
from flows.stages.trainer_slots import trainer_slot
from flows.tracking.studies import StudyRuns, TrialRun
from training.job import JobFolder, TrainJob
from training.loop.progress import HeldoutRecord, MetricsRecord
from training.tuning.key import TuningKey
from training.tuning.space import Params, apply_params, suggest


@dataclass(frozen=True)
class TuningData:
    """What trials train on and are scored on: never the evaluation days."""

    features: Features
    train_files: tuple[str, ...]
    validation_files: dict[str, tuple[str, ...]]  # name (a day, or "holdout") → feature files
    description: str


def validation_days(config: PipelineConfig) -> tuple[int, ...]:
    """The training days trials are scored on: `tuning.validation_days`, else the newest
    training days when `tuning.validation` asks for them (`auto`: on a dated warehouse with
    more training days than those), else none (a random slice of rows)."""
    tuning, data = config.tuning, config.data
    if tuning.validation_days:
        return tuning.validation_days
    newest = tuple(sorted(data.train_days)[-tuning.validation_newest_days :])
    enough = len(data.train_days) > tuning.validation_newest_days
    if tuning.validation == "newest_days" or (tuning.validation == "auto" and data.dated and enough):
        if not enough:
            raise ConfigError(f"tuning.validation = \"newest_days\": the {len(data.train_days)} training day(s) leave no "
                              f"day to train trials on besides the newest {tuning.validation_newest_days}; add "
                              "training days or set tuning.validation = \"random\"")  # fmt: skip
        return newest
    return ()


# Fewer training rows than this, and a study scores each trial on several folds
# (`tuning.validation_folds = 0`): one 10 % slice of a few thousand rows ranks trials by noise.
SMALL_DATA_ROWS = 50_000


def fold_count(config: PipelineConfig, train_rows: int) -> int:
    """How many validation slices a trial is scored on (random validation only)."""
    tuning = config.tuning
    if tuning.validation_folds:
        return tuning.validation_folds
    return min(3, int(100 // tuning.validation_percent)) if train_rows < SMALL_DATA_ROWS else 1


def tuning_folds(config: PipelineConfig, features: Features) -> list[TuningData]:
    """What trials train on and are scored on, one `TuningData` per fold: the validation days
    (`validation_days`; trials train on the other training days), else `fold_count` disjoint
    slices of `tuning.validation_percent` % of the training rows, chosen by a hash of each
    row (ingestion/holdout.py; each fold's runs train on the rest). The final run trains on
    the first fold's rest when its calibration share is the same (its calibrator is fitted on
    those rows), else on its own split (flows/run/rows.py)."""
    days, data = validation_days(config), config.data
    if days:
        train = features.train_files(tuple(d for d in data.train_days if d not in days))
        return [TuningData(features, train, {data.day_label(d): tuple(features.files[d]) for d in days},
                           f"validation days {data.shown_days(days)}"
                           + (" (the newest: progressive validation)" if not config.tuning.validation_days else ""))]  # fmt: skip
    percent, day_files = config.tuning.validation_percent, {day: features.files[day] for day in data.train_days}
    folds = fold_count(config, features.state.train_rows)
    splits = [holdout_of(config, features.state.state_id, day_files, percent, fold) for fold in range(folds)]
    of = f" (fold {{}} of {folds})" if folds > 1 else ""
    return [TuningData(features, split.fit_files, {"holdout": split.validation_files},
                       f"{split.validation_rows:,} held-out training rows ({percent:g} %){of.format(fold + 1)}, "
                       f"trials train on the other {split.fit_rows:,}")
            for fold, split in enumerate(splits)]  # fmt: skip


def tuning_data(config: PipelineConfig, features: Features) -> TuningData:
    """The first fold (`tuning_folds`)."""
    return tuning_folds(config, features)[0]


class TrainingTrial:
    """One trial: train with the suggested parameters, report held-out NE, return NE."""

    def __init__(self, config: PipelineConfig, folds: list[TuningData], runs: StudyRuns, parent_run: str,
                 key: TuningKey, log: logging.Logger | logging.LoggerAdapter) -> None:  # fmt: skip
        self.config, self.folds, self.runs, self.parent_run, self.key, self.log = (
            config, folds, runs, parent_run, key, log,
        )  # fmt: skip

    def __call__(self, trial: optuna.Trial) -> float:
        params = suggest(trial, self.config.tuning)
        out = self.config.path("tuning") / trial.study.study_name / f"trial-{trial.number:04d}"
        run = self.runs.start_trial(self.parent_run, trial.number,
                                    {"tuning.worker": str(trial.user_attrs.get("worker", 0)), **self.key.as_tags()},
                                    params)  # fmt: skip
        seeds = trial_seeds(self.config)
        per_seed: list[float] = []
        best_epochs: list[int] = []
        try:
            with trainer_slot(self.config, self.log):
                self._train_seeds(trial, run, params, out, per_seed, best_epochs)
        except optuna.TrialPruned as pruned:
            run.end("pruned")
            self.log.info("trial #%d pruned: %s", trial.number, pruned)
            raise
        except Exception:
            run.end("failed")
            raise
        except BaseException:  # Ctrl-C or SIGTERM: the trial is stopped, not failed
            run.end("stopped")
            raise
        ne = statistics.fmean(per_seed)
        trial.set_user_attr("ne_per_seed", {str(s): v for s, v in zip(seeds, per_seed, strict=True)})
        if best_epochs:
            chosen = {"training.epochs": round(statistics.fmean(best_epochs))}
            trial.set_user_attr("chosen", chosen)
            run.log_params(chosen)
            params = {**params, **chosen}
        run.log_metric("ne", ne)
        if len(seeds) > 1:
            run.log_metric("ne_seed_std", statistics.stdev(per_seed))
        run.end("complete")
        spread = f" (seeds {', '.join(f'{v:.5f}' for v in per_seed)})" if len(seeds) > 1 else ""
        self.log.info("trial #%d: NE %.5f%s with %s", trial.number, ne, spread, params)
        return ne

    def _train_seeds(self, trial: optuna.Trial, run: TrialRun, params: Params, out: Path, per_seed: list[float],
                     best_epochs: list[int]) -> None:  # fmt: skip
        """Train the trial once per seed and fold; each seed's validation NE (the mean over
        its folds) and each run's best epoch count are appended."""
        seeds, folds = trial_seeds(self.config), len(self.folds)
        per_run: dict[tuple[int, int], float] = {}
        for seed, fold, job in trial_jobs(self.config, self.folds, params, out, early_stopping=True):
            # Only the first run's held-out NE feeds the pruner: Optuna compares trials at
            # the same step, and every trial's first run has the same seed and fold.
            first = (seed, fold) == (seeds[0], 0)
            metric = "heldout_ne" + (f".seed_{seed}" if len(seeds) > 1 else "") + (f".fold_{fold}" if folds > 1 else "")
            # a run that chooses its own epochs is scored with the model it kept
            epochs = EpochEnds(1 if self.config.training.chooses_epochs else self.config.tuning.max_epochs)
            watch = functools.partial(self._on_progress, trial, run, metric=metric, prune=first,
                                      epochs=epochs)  # fmt: skip
            try:
                train_where_configured(self.config, job, f"{self.config.name}-{_job_name(out, seed, fold)}",
                                       lambda line: None, on_progress=watch)  # fmt: skip
            except StopEarly:
                pass  # the job is stopped; its best epoch's NE is the run's score
            if epochs.early_stopping:
                best_epoch, per_run[seed, fold] = epochs.best()
                best_epochs.append(best_epoch)
            else:
                per_run[seed, fold] = validation_ne(job.folder)
            if folds > 1:
                run.log_metric(f"ne.seed_{seed}.fold_{fold}", per_run[seed, fold])
            if fold == folds - 1:
                per_seed.append(statistics.fmean(per_run[seed, f] for f in range(folds)))
                if len(seeds) > 1:
                    run.log_metric(f"ne.seed_{seed}", per_seed[-1])
        if folds > 1:
            trial.set_user_attr("ne_per_fold", {str(f): statistics.fmean(per_run[s, f] for s in seeds)
                                                for f in range(folds)})  # fmt: skip

    def _on_progress(self, trial: optuna.Trial, run: TrialRun, record: MetricsRecord, *, metric: str,
                     prune: bool, epochs: EpochEnds | None = None) -> None:  # fmt: skip
        if not isinstance(record, HeldoutRecord):
            return
        step, total, ne = record.step, record.total_steps, record.heldout_ne
        if not math.isfinite(ne):
            raise optuna.TrialPruned(f"held-out NE is {ne} at step {step} (diverged)")
        run.log_metric(metric, ne, step=step)
        if epochs is not None and epochs.rose(record):
            raise StopEarly
        if not prune or step >= total:
            return  # the last report comes when the trial has cost all it will: never pruned there
        # Reported against percent of training done, so the pruner compares trials at the
        # same progress whatever their batch size, and waits out the warm-up.
        percent = round(100 * step / total)
        if ne >= NOT_LEARNING_NE and percent >= self.config.tuning.prune_after_pct:
            raise optuna.TrialPruned(f"held-out NE {ne:.5f} at step {step}/{total}: no better than the click rate")
        trial.report(ne, percent)
        if trial.should_prune():
            raise optuna.TrialPruned(f"held-out NE {ne:.5f} at step {step}/{total} is worse than the median")


# The constant click rate's NE: a trial still at or above it past `prune_after_pct` has
# learnt nothing, and is not worth the rest of its budget.
NOT_LEARNING_NE = 1.0


class StopEarly(Exception):
    """Validation NE rose from one epoch end to the next: the run has passed its best."""


class EpochEnds:
    """Validation NE at each epoch end of one run, for early stopping (when a trial may
    train more than one epoch: `tuning.max_epochs` > 1)."""

    def __init__(self, max_epochs: int) -> None:
        self.early_stopping = max_epochs > 1
        self.max_epochs = max_epochs
        self.ne: list[float] = []

    def rose(self, record: HeldoutRecord) -> bool:
        """Take an epoch end's NE; True when it is worse than the best epoch's before it."""
        if not self.early_stopping or record.step % record.steps_per_epoch:
            return False
        self.ne.append(record.heldout_ne)
        return len(self.ne) > 1 and self.ne[-1] > min(self.ne[:-1])

    def best(self) -> tuple[int, float]:
        """(epochs trained at the best epoch end, its NE)."""
        if not self.ne:
            raise optuna.TrialPruned("no epoch ended with a validation NE")
        best = min(range(len(self.ne)), key=self.ne.__getitem__)
        return best + 1, self.ne[best]


def trial_seeds(config: PipelineConfig) -> list[int]:
    """The training seeds every trial of the study runs (the same for all trials)."""
    return [config.training.seed + i for i in range(config.tuning.seeds_per_trial)]


def trial_jobs(config: PipelineConfig, folds: list[TuningData], params: Params, out: Path,
               early_stopping: bool = False) -> Iterator[tuple[int, int, TrainJob]]:  # fmt: skip
    """One validation run per trial seed and fold, each in its own folder under `out`
    (`seed-S/`, `fold-F/`, where there are several)."""
    seeds = trial_seeds(config)
    for seed in seeds:
        for fold, data in enumerate(folds):
            folder = out / (f"seed-{seed}" if len(seeds) > 1 else "") / (f"fold-{fold}" if len(folds) > 1 else "")
            yield seed, fold, validation_job(config, data, params, folder, seed, early_stopping)


def validation_job(config: PipelineConfig, data: TuningData, params: Params, out: Path,
                   seed: int | None = None, early_stopping: bool = False) -> TrainJob:  # fmt: skip
    """A training run of `config` with `params` applied (and another training seed, if
    given) on the tuning data's training part, scored on its validation part. With
    `early_stopping` and `tuning.max_epochs` > 1, it runs up to that many epochs and is
    scored on all the validation rows at each epoch end."""
    training, model = apply_params(config.training, config.model, params)
    training = dataclasses.replace(training, checkpoint_every=0, max_restarts=0,
                                   seed=training.seed if seed is None else seed)  # fmt: skip
    evaluation = config.evaluation
    # (a trial of a run that chooses its length chooses its own, on its validation rows)
    if early_stopping and config.tuning.max_epochs > 1 and not training.chooses_epochs:
        # up to max_epochs, scored at every epoch end on all the validation rows (early stopping)
        training = dataclasses.replace(training, epochs=config.tuning.max_epochs)
        evaluation = dataclasses.replace(evaluation, heldout_every_epoch=True, heldout_batches=0)
    trial_config = dataclasses.replace(config, training=training, model=model, evaluation=evaluation)
    job = build_job(trial_config, data.features, run_id=out.name)
    # a trial is scored on its validation rows alone: no calibrator is fitted
    return dataclasses.replace(job, train_files=data.train_files, calibration_files=(), refit_files=(),
                               eval_files=data.validation_files,
                               validation_files=tuple(f for files in data.validation_files.values() for f in files)
                               if training.chooses_epochs else (), out_dir=str(out))  # fmt: skip


def train_and_score(config: PipelineConfig, features: Features, params: Params, out: Path) -> float:
    """Training runs with fixed parameters, one per trial seed and fold; their mean NE on
    the validation rows, comparable with the study's trial values."""
    scores = []
    for seed, fold, job in trial_jobs(config, tuning_folds(config, features), params, out):
        train_where_configured(config, job, f"{config.name}-{_job_name(out, seed, fold)}", lambda line: None)
        scores.append(validation_ne(job.folder))
    return statistics.fmean(scores)


def _job_name(out: Path, seed: int, fold: int) -> str:
    """A trial run's name in the scheduler's queue: its folder, seed and fold."""
    return f"{out.name}-seed{seed}-fold{fold}"


def validation_ne(folder: JobFolder) -> float:
    """NE over every validation part a run scored; a diverged model (NaN predictions) is
    pruned, not failed."""
    scores = folder.read_predictions()
    try:
        ne = compute_ne(binary_state(scores.labels, scores.predictions))
    except MetricError as error:
        raise optuna.TrialPruned(f"validation NE cannot be computed: {error}") from None
    if not math.isfinite(ne):
        raise optuna.TrialPruned(f"validation NE is {ne}")
    return ne

