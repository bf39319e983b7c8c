"""The `retune` flow: an Optuna study over the hyperparameters of the coming run's key.

Each trial is a real sharded training run (torchrun, the same trainer as the pipeline)
scored by NE on the validation days; held-out NE during training feeds the pruner, which
stops a hopeless trial early. Several `dlrm retune` workers (processes or hosts) on one
PostgreSQL storage join the same study.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from mlflow.entities import Param
from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.exceptions import MissingContextError

from evaluation.metrics import MetricError, binary_state, compute_ne
from flows.calibrate import holdout_of
from flows.config import ConfigError, PipelineConfig, load_flow_config
from flows.feature_files import Features
from flows.features import prepare_features, run_logger
from flows.reports import RetuneReport
from flows.resolve import ResolvedRun, resolve_run
from flows.stopped_runs import cancel_when_stopped
from flows.tracking import ensure_experiment, log_study_plots
from flows.train_stage import build_job
from flows.trainer_slots import trainer_slot
from training.codec import encode
from training.job import JobFolder, TrainJob
from training.launch.launcher import launch
from training.locking import exclusive
from training.loop.progress import HeldoutRecord, MetricsRecord
from training.tuning.config import TuningConfig, budget_overrides
from training.tuning.decision import paired_gain
from training.tuning.key import TuningKey
from training.tuning.space import Params, apply_params, params_of, suggest
from training.tuning.study import (
    DECISION,
    TunedParams,
    best_of,
    enqueue_warm_start,
    join_as_worker,
    open_storage,
    open_study,
    run_worker,
    tuned_keys,
)


@dataclass(frozen=True)
class RetuneResult:
    study_name: str
    key: TuningKey
    best: TunedParams | None
    trials_run: list[int]
    stopped_by: str
    warm_started: int
    mlflow_parent_run_id: str
    decision: str = ""  # the best trial against the configured values

    def report(self) -> RetuneReport:
        return RetuneReport(
            study=self.study_name, tuning_key=self.key.fingerprint, best_ne=self.best.ne if self.best else None,
            best_params=self.best.params if self.best else None,
            best_trial=self.best.trial_number if self.best else None, trials_run_here=self.trials_run,
            stopped_by=self.stopped_by, warm_start_trials=self.warm_started,
            mlflow_parent_run_id=self.mlflow_parent_run_id, decision=self.decision,
        )  # fmt: skip


@flow(name="retune", log_prints=True, on_crashed=[cancel_when_stopped])
def retune(
    config_path: str = "configs/demo.toml",
    overrides: list[str] | None = None,
    n_trials: int | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Tune the hyperparameters of the config's key; the budget may be set per call."""
    return retune_of(load_flow_config(config_path, [*(overrides or []), *budget_overrides(n_trials, timeout_s)]))


def budget_text(tuning: TuningConfig) -> str:
    """A study's budget, for the log: its trial count and its time, as set."""
    trials = f"{tuning.n_trials} trials" if tuning.n_trials else "trials"
    if not tuning.timeout_s:
        return trials
    return f"{trials} until {tuning.timeout_s:.0f} s" if not tuning.n_trials else f"{trials}, {tuning.timeout_s:.0f} s"


@flow(name="retune", log_prints=True, on_crashed=[cancel_when_stopped])
def retune_of(config: PipelineConfig) -> dict[str, Any]:
    """The `retune` flow on a config the caller has loaded (`dlrm retune` reads its file once)."""
    features = prepare_features(config)
    return encode(run_retune(resolve_run(config, state=features.state), features).report())



def run_retune(run: ResolvedRun, features: Features) -> RetuneResult:
    """Join (or start) the study of the run's key, run trials until the budget is spent,
    log the best."""
    log = run_logger("flows.retune")
    config, key = run.config, run.key
    storage_url = config.optuna_storage
    storage = open_storage(storage_url, config.tuning.heartbeat_s)
    study = open_study(storage, config.name, key, config.tuning)
    worker = join_as_worker(study, storage_url, config.tuning)
    others = [t for t in tuned_keys(storage, config.name) if t.key != key]
    nearest = min(others, key=lambda t: (key.distance(t.key), t.ne)) if others else None
    warm = enqueue_warm_start(study, storage_url, nearest, key.global_batch_size, config.tuning)
    client = MlflowClient(tracking_uri=config.tracking_uri)
    parent = _parent_run(client, config, study, key, storage_url)
    log.info(
        "retune: study %s (key %s), worker %d, budget %s%s", study.study_name, key.fingerprint, worker,
        budget_text(config.tuning),
        f"; warm start from {nearest.study_name} with {warm} scaled trial(s)" if warm and nearest else "",
    )  # fmt: skip
    data = tuning_data(config, features)
    log.info("retune: trials are scored on %s, never on the evaluation days", data.description)
    objective = TrainingTrial(config, data, client, parent, key, log)
    try:
        outcome = run_worker(study, objective, config.tuning, storage_url, worker)
    except BaseException as error:  # the study's MLflow run is not left running
        client.set_terminated(parent, "FAILED" if isinstance(error, Exception) else "KILLED")  # KILLED: Ctrl-C
        raise
    best, verdict = best_of(study), ""
    if best is not None:
        with trainer_slot(config, log):
            verdict = judge_against_configured(config, data, study, best, log)["verdict"]
        best = best_of(study)  # the configured values, if the trial did not beat them beyond the noise
    _finish_parent(client, parent, study, best)
    _publish(study, best)
    if best:
        log.info("retune: best NE %.5f (%s): %s", best.ne,
                 "the configured values" if best.trial_number < 0 else f"trial #{best.trial_number}", best.params)  # fmt: skip
    return RetuneResult(study.study_name, key, best, outcome.trials_run, outcome.stopped_by, warm, parent, verdict)


def judge_against_configured(config: PipelineConfig, data: TuningData, study: optuna.Study, best: TunedParams,
                             log: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:  # fmt: skip
    """Train the configured values and the best trial's values once each, as a run would (the
    trial's chosen epochs, the first trial seed, the same rows), and keep the tuned values
    only if a paired bootstrap over the validation rows finds them better beyond the noise.
    The verdict is stored with the study (`decision`), once per best trial."""
    configured = params_of(config.training, config.model, config.tuning)
    earlier = study.user_attrs.get(DECISION)
    if earlier and earlier.get("trial") == best.trial_number and earlier.get("configured_params") == configured:
        return earlier
    folder = config.path("tuning") / study.study_name / "decision" / _digest(configured)
    seed = trial_seeds(config)[0]
    scores = {}
    for name, params in (("configured", configured), (f"trial-{best.trial_number:04d}", best.params)):
        job = validation_job(config, data, params, folder / name, seed)
        if not (job.folder.summary_file.is_file() and job.folder.read_predictions().labels.size):
            launch(job, on_line=lambda line: None)
        scores[name] = job.folder.read_predictions()
    first, second = scores.values()
    gain = paired_gain(first.labels, first.predictions, second.predictions)
    decision = {
        "trial": best.trial_number, "kept_configured": not gain.real, "configured_params": configured,
        "configured_ne": compute_ne(binary_state(first.labels, first.predictions)),
        "tuned_ne": compute_ne(binary_state(second.labels, second.predictions)),
        "gain": gain.gain, "gain_low": gain.low, "gain_high": gain.high, "rows": gain.rows,
    }  # fmt: skip
    verdict = "kept the configured values" if not gain.real else f"trial #{best.trial_number} replaces the configured values"
    decision["verdict"] = (f"{verdict}: NE {decision['configured_ne']:.5f} (configured) against "
                           f"{decision['tuned_ne']:.5f} (trial #{best.trial_number}, retrained as a run trains it); "
                           f"{gain.describe()}")  # fmt: skip
    study.set_user_attr(DECISION, decision)
    log.info("retune: %s", decision["verdict"])
    return decision


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


def tuning_data(config: PipelineConfig, features: Features) -> TuningData:
    """The validation days (`validation_days`; trials train on the other training days), else
    a slice of `tuning.validation_percent` % of the training rows, chosen by a hash of each
    row (ingestion/holdout.py; trials train on the rest). The final run trains on the same
    rest when its calibration share is the same (its calibrator is fitted on these rows), else
    on its own split (flows/calibrate.py)."""
    days, data = validation_days(config), config.data
    if days:
        train = features.train_files(tuple(d for d in data.train_days if d not in days))
        return TuningData(features, train, {data.day_label(d): tuple(features.files[d]) for d in days},
                          f"validation days {data.shown_days(days)}"
                          + (" (the newest: progressive validation)" if not config.tuning.validation_days else ""))  # fmt: skip
    percent = config.tuning.validation_percent
    split = holdout_of(config, features.state.state_id, {day: features.files[day] for day in data.train_days}, percent)
    return TuningData(features, split.fit_files, {"holdout": split.validation_files},
                      f"{split.validation_rows:,} held-out training rows ({percent:g} %), trials train on "
                      f"the other {split.fit_rows:,}")  # fmt: skip


class TrainingTrial:
    """One trial: train with the suggested parameters, report held-out NE, return NE."""

    def __init__(self, config: PipelineConfig, data: TuningData, client: MlflowClient, parent_run: str,
                 key: TuningKey, log: logging.Logger | logging.LoggerAdapter) -> None:  # fmt: skip
        self.config, self.data, self.client, self.parent_run, self.key, self.log = (
            config, data, client, parent_run, key, log,
        )  # fmt: skip

    def __call__(self, trial: optuna.Trial) -> float:
        params = suggest(trial, self.config.tuning)
        out = self.config.path("tuning") / trial.study.study_name / f"trial-{trial.number:04d}"
        run = self.client.create_run(
            self.client.get_run(self.parent_run).info.experiment_id, run_name=f"trial-{trial.number}",
            tags={"mlflow.parentRunId": self.parent_run, "tuning.trial": str(trial.number),
                  "tuning.worker": str(trial.user_attrs.get("worker", 0)), **self.key.as_tags()},
        )  # fmt: skip
        run_id = run.info.run_id
        self.client.log_batch(run_id, params=[_param(k, v) for k, v in params.items()])
        seeds = trial_seeds(self.config)
        per_seed: list[float] = []
        best_epochs: list[int] = []
        try:
            with trainer_slot(self.config, self.log):
                self._train_seeds(trial, run_id, params, out, per_seed, best_epochs)
        except optuna.TrialPruned as pruned:
            self.client.set_tag(run_id, "tuning.state", "pruned")
            self.client.set_terminated(run_id, "KILLED")
            self.log.info("trial #%d pruned: %s", trial.number, pruned)
            raise
        except Exception:
            self.client.set_tag(run_id, "tuning.state", "failed")
            self.client.set_terminated(run_id, "FAILED")
            raise
        except BaseException:  # Ctrl-C or SIGTERM: the trial is stopped, not failed
            self.client.set_tag(run_id, "tuning.state", "stopped")
            self.client.set_terminated(run_id, "KILLED")
            raise
        ne = statistics.fmean(per_seed)
        trial.set_user_attr("ne_per_seed", {str(s): v for s, v in zip(seeds, per_seed, strict=True)})
        if best_epochs:
            chosen = {"training.epochs": round(statistics.fmean(best_epochs))}
            trial.set_user_attr("chosen", chosen)
            self.client.log_batch(run_id, params=[_param(k, v) for k, v in chosen.items()])
            params = {**params, **chosen}
        self.client.log_metric(run_id, "ne", ne)
        if len(seeds) > 1:
            self.client.log_metric(run_id, "ne_seed_std", statistics.stdev(per_seed))
        self.client.set_tag(run_id, "tuning.state", "complete")
        self.client.set_terminated(run_id, "FINISHED")
        spread = f" (seeds {', '.join(f'{v:.5f}' for v in per_seed)})" if len(seeds) > 1 else ""
        self.log.info("trial #%d: NE %.5f%s with %s", trial.number, ne, spread, params)
        return ne

    def _train_seeds(self, trial: optuna.Trial, run_id: str, params: Params, out: Path, per_seed: list[float],
                     best_epochs: list[int]) -> None:  # fmt: skip
        """Train the trial once per seed; each seed's validation NE (and best epoch count) is appended."""
        seeds = trial_seeds(self.config)
        for seed, job in seed_jobs(self.config, self.data, params, out, early_stopping=True):
            # Only the first seed's held-out NE feeds the pruner: Optuna compares trials
            # at the same step, and every trial's first run has the same seed.
            first = seed == seeds[0]
            metric = "heldout_ne" if len(seeds) == 1 else f"heldout_ne.seed_{seed}"
            epochs = EpochEnds(self.config.tuning.max_epochs)
            watch = functools.partial(self._on_progress, trial, run_id, metric=metric, prune=first,
                                      epochs=epochs)  # fmt: skip
            try:
                launch(job, on_line=lambda line: None, on_progress=watch)
            except StopEarly:
                pass  # the job is stopped; its best epoch's NE is the seed's score
            if epochs.early_stopping:
                best_epoch, ne = epochs.best()
                best_epochs.append(best_epoch)
                per_seed.append(ne)
            else:
                per_seed.append(validation_ne(job.folder))
            if len(seeds) > 1:
                self.client.log_metric(run_id, f"ne.seed_{seed}", per_seed[-1])

    def _on_progress(self, trial: optuna.Trial, run_id: str, record: MetricsRecord, *, metric: str,
                     prune: bool, epochs: EpochEnds | None = None) -> None:  # fmt: skip
        if not isinstance(record, HeldoutRecord):
            return
        step, total, ne = record.step, record.total_steps, record.heldout_ne
        if not math.isfinite(ne):
            raise optuna.TrialPruned(f"held-out NE is {ne} at step {step} (diverged)")
        self.client.log_metric(run_id, metric, ne, step=step)
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


def seed_jobs(config: PipelineConfig, data: TuningData, params: Params, out: Path,
              early_stopping: bool = False) -> Iterator[tuple[int, TrainJob]]:  # fmt: skip
    """One validation run per trial seed, each in its own folder under `out` (when several)."""
    seeds = trial_seeds(config)
    for seed in seeds:
        folder = out if len(seeds) == 1 else out / f"seed-{seed}"
        yield seed, validation_job(config, data, params, folder, seed, early_stopping)


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
    if early_stopping and config.tuning.max_epochs > 1:
        # up to max_epochs, scored at every epoch end on all the validation rows (early stopping)
        training = dataclasses.replace(training, epochs=config.tuning.max_epochs)
        evaluation = dataclasses.replace(evaluation, heldout_every_epoch=True, heldout_batches=0)
    trial_config = dataclasses.replace(config, training=training, model=model, evaluation=evaluation)
    job = build_job(trial_config, data.features, run_id=out.name)
    return dataclasses.replace(job, train_files=data.train_files, eval_files=data.validation_files, out_dir=str(out))


def train_and_score(config: PipelineConfig, features: Features, params: Params, out: Path) -> float:
    """Training runs with fixed parameters, one per trial seed; their mean NE on the
    validation rows, comparable with the study's trial values."""
    data = tuning_data(config, features)
    scores = []
    for _, job in seed_jobs(config, data, params, out):
        launch(job, on_line=lambda line: None)
        scores.append(validation_ne(job.folder))
    return statistics.fmean(scores)


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


def _parent_run(client: MlflowClient, config: PipelineConfig, study: optuna.Study, key: TuningKey, url: str) -> str:
    """The study's one MLflow parent run, created by its first worker."""
    with exclusive(url, f"{study.study_name}.mlflow"):
        existing = study.user_attrs.get("mlflow_parent_run_id")
        if existing:
            return str(existing)
        experiment = ensure_experiment(client, config.tracking.experiment, config.artifact_location)
        run = client.create_run(
            experiment, run_name=f"retune-{study.study_name}",
            tags={"tuning.study": study.study_name, "tuning.storage": _redact(url), **key.as_tags()},
        )  # fmt: skip
        study.set_user_attr("mlflow_parent_run_id", run.info.run_id)
        return run.info.run_id


def _finish_parent(client: MlflowClient, parent: str, study: optuna.Study, best: TunedParams | None) -> None:
    states = [t.state.name.lower() for t in study.get_trials(deepcopy=False)]
    for state in ("complete", "pruned", "fail"):
        client.log_metric(parent, f"trials_{state}", float(states.count(state)))
    if best:
        client.log_metric(parent, "best_ne", best.ne)
        client.log_batch(parent, params=[_param(f"best.{k}", v) for k, v in best.params.items()])
        client.set_tag(parent, "tuning.best_trial", str(best.trial_number))
        client.log_dict(parent, {"best_ne": best.ne, "best_trial": best.trial_number, "params": best.params},
                        "tuning/best.json")  # fmt: skip
    log_study_plots(client, parent, study)
    client.set_terminated(parent, "FINISHED")


def _publish(study: optuna.Study, best: TunedParams | None) -> None:
    """A Prefect table of the study's trials (only inside a flow run)."""
    try:
        get_run_logger()
    except MissingContextError:
        return
    rows = [
        {"trial": t.number, "state": t.state.name, "ne": t.value, "worker": t.user_attrs.get("worker"),
         **{k: v for k, v in t.params.items()}}
        for t in study.get_trials(deepcopy=False)
    ]  # fmt: skip
    create_table_artifact(
        key="retune-trials", table=rows,
        description=f"Study {study.study_name}: best NE {best.ne:.5f}" if best else f"Study {study.study_name}",
    )  # fmt: skip


def _digest(params: Params) -> str:
    """A short name for a set of parameter values (a folder per configured set)."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _param(name: str, value: Any) -> Param:
    return Param(name, str(value))


def _redact(url: str) -> str:
    """A storage URL without its password, for tags."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)

