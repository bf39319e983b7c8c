"""The `retune` flow: an Optuna study over the hyperparameters of the coming run's key.

Each trial (flows/tuning/trials.py) is a real sharded training run (torchrun, the same trainer as
the pipeline) scored by NE on validation rows; held-out NE during training feeds the
pruner, which stops a hopeless trial early. The best trial then faces the configured values
(`judge_against_configured`). Several `dlrm retune` workers (processes or hosts) on one
PostgreSQL storage join the same study.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from training.launch.interpreter import imports_without_collection

# A deployment's flow run (`python -m prefect.engine`, from `dlrm serve` or a worker) imports
# this file first: its imports with the collector paused, as a command's and a rank's are
# (training/launch/interpreter.py; bench/start_up.py's deployment start-ups)
with imports_without_collection():
    import optuna
    from prefect import flow, get_run_logger
    from prefect.artifacts import create_table_artifact
    from prefect.exceptions import MissingContextError

    from evaluation.metrics import binary_state, compute_ne
    from evaluation.report import Scores
    from flows.run.config import PipelineConfig, load_flow_config
    from flows.run.crosses import with_run_crosses
    from flows.run.feature_files import Features
    from flows.run.reports import RetuneReport
    from flows.run.resolve import ResolvedRun, resolve_run
    from flows.stages import heartbeats
    from flows.stages.features import prepare_features, run_logger
    from flows.stages.stopped_runs import cancel_when_stopped
    from flows.stages.train_slurm import train_where_configured
    from flows.stages.trainer_slots import trainer_slot
    from flows.tracking.studies import BestTrial, StudyRuns
    from flows.tuning.trials import (
        TrainingTrial,
        TuningData,
        trial_seeds,
        tuning_folds,
        validation_job,
    )
    from training.codec import encode
    from training.locking import exclusive
    from training.tuning.config import TuningConfig, budget_overrides
    from training.tuning.decision import paired_gain
    from training.tuning.key import TuningKey
    from training.tuning.space import Params, params_of, resolved_batches
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

heartbeats.install()  # this module's flow runs end when their work ends


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
    features, crossed = with_run_crosses(resolve_run(config, state=features.state), features)
    if crossed:
        run_logger("flows.tuning.retune").info("%s", crossed)
    return encode(run_retune(resolve_run(config, state=features.state), features).report())



def run_retune(run: ResolvedRun, features: Features) -> RetuneResult:
    """Join (or start) the study of the run's key, run trials until the budget is spent,
    log the best."""
    log = run_logger("flows.tuning.retune")
    config, key = run.config, run.key
    storage_url = config.optuna_storage
    storage = open_storage(storage_url, config.tuning.heartbeat_s)
    study = open_study(storage, config.name, key, config.tuning)
    worker = join_as_worker(study, storage_url, config.tuning)
    others = [t for t in tuned_keys(storage, config.name) if t.key != key]
    nearest = min(others, key=lambda t: (key.distance(t.key), t.ne)) if others else None
    warm = enqueue_warm_start(study, storage_url, nearest, key.global_batch_size, config.tuning)
    runs = StudyRuns(config.tracking_uri)
    parent = _parent_run(runs, config, study, key, storage_url)
    log.info(
        "retune: study %s (key %s), worker %d, budget %s%s", study.study_name, key.fingerprint, worker,
        budget_text(config.tuning),
        f"; warm start from {nearest.study_name} with {warm} scaled trial(s)" if warm and nearest else "",
    )  # fmt: skip
    folds = tuning_folds(config, features)
    log.info("retune: trials are scored on %s, never on the evaluation days", "; ".join(f.description for f in folds))
    log.info("retune: batch sizes %s; up to %d epoch(s) a trial%s", ", ".join(f"{b:,}" for b in resolved_batches(config.tuning))
             or f"{config.training.batch_size:,} (the run's)", config.tuning.max_epochs,
             ", stopped early when validation NE rises" if config.tuning.max_epochs > 1 else "")  # fmt: skip
    objective = TrainingTrial(config, folds, runs, parent, key, log)
    try:
        outcome = run_worker(study, objective, config.tuning, storage_url, worker)
    except BaseException as error:  # the study's MLflow run is not left running
        runs.end_parent(parent, failed=isinstance(error, Exception))  # not failed: Ctrl-C
        raise
    best, verdict = best_of(study), ""
    if best is not None:
        with trainer_slot(config, log):
            verdict = judge_against_configured(config, folds, study, best, log)["verdict"]
        best = best_of(study)  # the configured values, if the trial did not beat them beyond the noise
    states = [t.state.name.lower() for t in study.get_trials(deepcopy=False)]
    runs.finish_parent(parent, states, BestTrial(best.ne, best.trial_number, best.params) if best else None, study)
    _publish(study, best)
    if best:
        log.info("retune: best NE %.5f (%s): %s", best.ne,
                 "the configured values" if best.trial_number < 0 else f"trial #{best.trial_number}", best.params)  # fmt: skip
    return RetuneResult(study.study_name, key, best, outcome.trials_run, outcome.stopped_by, warm, parent, verdict)


def judge_against_configured(config: PipelineConfig, folds: list[TuningData], study: optuna.Study,
                             best: TunedParams, log: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:  # fmt: skip
    """Train the configured values and the best trial's values once each per fold, as a run
    would (the trial's chosen epochs, the first trial seed, the same rows), and keep the
    tuned values only if a paired bootstrap over the validation rows (every fold's: each
    scored by the run that did not train on it) finds them better beyond the noise. The
    verdict is stored with the study (`decision`), once per best trial."""
    configured = params_of(config.training, config.model, config.tuning)
    earlier = study.user_attrs.get(DECISION)
    if earlier and earlier.get("trial") == best.trial_number and earlier.get("configured_params") == configured:
        return earlier
    folder = config.path("tuning") / study.study_name / "decision" / _digest(configured)
    seed = trial_seeds(config)[0]
    scores = {}
    for name, params in (("configured", configured), (f"trial-{best.trial_number:04d}", best.params)):
        parts = []
        for fold, data in enumerate(folds):
            job = validation_job(config, data, params, folder / name / (f"fold-{fold}" if len(folds) > 1 else ""), seed)
            if not (job.folder.summary_file.is_file() and job.folder.read_predictions().labels.size):
                train_where_configured(config, job, f"{config.name}-decision-{name}-fold{fold}", lambda line: None)
            parts.append(job.folder.read_predictions())
        scores[name] = Scores.concat(parts)
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


def _parent_run(runs: StudyRuns, config: PipelineConfig, study: optuna.Study, key: TuningKey, url: str) -> str:
    """The study's one MLflow parent run, created by its first worker."""
    with exclusive(url, f"{study.study_name}.mlflow"):
        existing = study.user_attrs.get("mlflow_parent_run_id")
        if existing:
            return str(existing)
        tags = {"tuning.study": study.study_name, "tuning.storage": _redact(url), **key.as_tags()}
        run_id = runs.open_parent(config.tracking.experiment, config.artifact_location, study.study_name, tags)
        study.set_user_attr("mlflow_parent_run_id", run_id)
        return run_id


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


def _redact(url: str) -> str:
    """A storage URL without its password, for tags."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)

