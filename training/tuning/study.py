"""Optuna studies, one per (model, tuning key), shared by every worker that joins them.

A worker claims a trial under a lock held where the study is stored, so workers on
several processes or hosts together run exactly `n_trials` finished trials: none lost,
none run twice. A worker that dies stops beating; its trial is marked failed and its
parameters are queued again, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import FrozenTrial, Trial, TrialState

from training.locking import exclusive
from training.tuning.config import TuningConfig
from training.tuning.key import TuningKey
from training.tuning.space import Params, clip_to_space, scale_params

# Heartbeats and stale-trial retries are stable in use but still flagged experimental.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
# Trials are claimed with ask/tell (under a lock), and beat through the same storage API.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
Objective = Callable[[Trial], float]


@dataclass(frozen=True)
class TunedParams:
    """The best trial of a key's study."""

    key: TuningKey
    params: Params
    ne: float
    trial_number: int
    study_name: str
    # the trial's validation NE per training seed, in seed order (`tuning.seeds_per_trial`);
    # empty for one seed, and for the configured values a verdict kept
    ne_per_seed: tuple[float, ...] = ()

    @property
    def seed_spread(self) -> float | None:
        """(max − min) / min of the NE over the trial's seeds; None unless it trained several."""
        if len(self.ne_per_seed) < 2:
            return None
        return (max(self.ne_per_seed) - min(self.ne_per_seed)) / min(self.ne_per_seed)


def study_name(model: str, key: TuningKey) -> str:
    return f"{model}.{key.fingerprint}"


def open_storage(url: str, heartbeat_s: int) -> RDBStorage:
    """The study store, with heartbeats so a dead worker's trial is retried (once more)."""
    return RDBStorage(
        url,
        engine_kwargs={"pool_pre_ping": True},
        heartbeat_interval=heartbeat_s,
        grace_period=3 * heartbeat_s,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2),
    )


def open_study(storage: RDBStorage, model: str, key: TuningKey, space: TuningConfig) -> optuna.Study:
    """Create or load the key's study (its sampler seeded for worker 0; see `join_as_worker`)."""
    study = optuna.create_study(
        storage=storage, study_name=study_name(model, key), direction="minimize",
        sampler=make_sampler(space, space.seed), pruner=_pruner(space), load_if_exists=True,
    )  # fmt: skip
    if "tuning_key" not in study.user_attrs:
        study.set_user_attr("tuning_key", asdict(key))
        study.set_user_attr("model", model)
    return study


def make_sampler(space: TuningConfig, seed: int) -> optuna.samplers.BaseSampler:
    """A seeded Bayesian sampler: a Gaussian process, or multivariate TPE."""
    startup = max(2, space.n_trials // 3) if space.n_trials else 4
    if space.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=startup, multivariate=True, constant_liar=True, warn_independent_sampling=False
    )


def _pruner(space: TuningConfig) -> optuna.pruners.BasePruner:
    if space.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=space.prune_after_pct)
    if space.pruner == "hyperband":  # resources are percent of training done
        return optuna.pruners.HyperbandPruner(min_resource=max(1, space.prune_after_pct), max_resource=100)
    return optuna.pruners.NopPruner()


def join_as_worker(study: optuna.Study, storage_url: str, space: TuningConfig) -> int:
    """Register this process as one of the study's workers and return its index (0 for the
    first ever). Worker i seeds its sampler with seed + i, so concurrent workers do not
    propose the same points."""
    with exclusive(storage_url, f"{study.study_name}.workers"):
        index = sum(1 for name in study.user_attrs if name.startswith("worker."))
        study.set_user_attr(f"worker.{index}", f"{socket.gethostname()}:{os.getpid()}")
    study.sampler = make_sampler(space, space.seed + index)
    return index


def enqueue_warm_start(
    study: optuna.Study, storage_url: str, nearest: TunedParams | None, batch_size: int, space: TuningConfig
) -> int:
    """Queue the nearest key's best, scaled to this batch size by the linear and the
    square-root rules, as the first trials (once per study). Returns how many were queued."""
    if nearest is None or not space.warm_start:
        return 0
    with exclusive(storage_url, f"{study.study_name}.claim"):
        if study.user_attrs.get("warm_started"):
            return 0
        return _enqueue_scaled(study, nearest, batch_size, space)


def _enqueue_scaled(study: optuna.Study, nearest: TunedParams, batch_size: int, space: TuningConfig) -> int:
    """Both rules on both learning rates, and the mix of linear for the embeddings with √
    for the dense layers: an embedding row is updated once per step it appears in, so its
    update count falls linearly with the batch, while dense gradients average over it.
    Last, the parameters as tuned, unscaled: the retune never starts below "no retune"."""
    sqrt = scale_params(nearest.params, nearest.key.global_batch_size, batch_size, "sqrt")
    linear = scale_params(nearest.params, nearest.key.global_batch_size, batch_size, "linear")
    mixed = {**sqrt, "training.embedding_lr": linear.get("training.embedding_lr")}
    points: list[Params] = []
    for point in (sqrt, linear, mixed, dict(nearest.params)):
        point = clip_to_space({k: v for k, v in point.items() if v is not None}, space)
        if point not in points:
            points.append(point)
    for point in points:
        study.enqueue_trial(point, user_attrs={"warm_start": f"{nearest.study_name}#{nearest.trial_number}"})
    study.set_user_attr("warm_started", True)
    return len(points)


@dataclass(frozen=True)
class WorkerOutcome:
    trials_run: list[int]  # trial numbers this worker finished (complete or pruned)
    stopped_by: str  # "budget" | "timeout"


def run_worker(
    study: optuna.Study, objective: Objective, space: TuningConfig, storage_url: str, worker: int = 0
) -> WorkerOutcome:
    """Claim and run trials until the study has `n_trials` counted (0: no count) or the time
    is up."""
    deadline = time.monotonic() + space.timeout_s if space.timeout_s else float("inf")
    finished: list[int] = []
    while time.monotonic() < deadline:
        trial = _claim(study, space.n_trials, storage_url)
        if trial is None:
            return WorkerOutcome(finished, "budget")
        with _heartbeat(study, trial):
            trial.set_user_attr("worker", worker)
            try:
                value = objective(trial)
            except optuna.TrialPruned:
                study.tell(trial, state=TrialState.PRUNED)
                finished.append(trial.number)
                continue
            except Exception:
                study.tell(trial, state=TrialState.FAIL)
                raise
        study.tell(trial, value)
        finished.append(trial.number)
    return WorkerOutcome(finished, "timeout")


def _claim(study: optuna.Study, n_trials: int, storage_url: str) -> Trial | None:
    """A new trial, or None when the budget is taken (all under the study's lock)."""
    with exclusive(storage_url, f"{study.study_name}.claim"):
        fail_stale_trials(study)  # a dead worker's trial goes back to the queue
        counted = study.get_trials(deepcopy=False, states=COUNTED)
        if n_trials and len(counted) >= n_trials:  # 0: no count (the time bounds the study)
            return None
        return study.ask()


@contextmanager
def _heartbeat(study: optuna.Study, trial: Trial) -> Iterator[None]:
    storage = study._storage  # the storage the study was opened with (behind a cache)
    if not hasattr(storage, "record_heartbeat") or storage.get_heartbeat_interval() is None:
        yield
        return
    stop = threading.Event()
    interval = storage.get_heartbeat_interval() or 10

    def beat() -> None:
        while not stop.is_set():
            storage.record_heartbeat(trial._trial_id)  # the trial id is what heartbeats are keyed by
            stop.wait(interval)

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# The study's verdict on its best trial against the configured values (flows/tuning/retune.py).
DECISION = "decision"


def best_of(study: optuna.Study) -> TunedParams | None:
    """The best trial, or the configured values where the verdict kept them
    (`trial_number` -1)."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not complete:
        return None
    best = min(complete, key=lambda t: t.value)  # type: ignore[arg-type, return-value]
    return _as_judged(_tuned(study.user_attrs, best, study.study_name), study.user_attrs)


def _tuned(attrs: dict[str, Any], best: FrozenTrial, study: str) -> TunedParams:
    """A study's best finished trial, as the parameters it tuned."""
    return TunedParams(_key_of(attrs), trial_params(best), float(best.value), best.number, study,  # type: ignore[arg-type]
                       trial_seeds_ne(best))  # fmt: skip


def _as_judged(best: TunedParams, attrs: dict[str, Any]) -> TunedParams:
    """The best trial as the study's verdict on it stands: the configured values when they
    were kept (a verdict on another trial no longer applies)."""
    decision = attrs.get(DECISION) or {}
    if decision.get("trial") != best.trial_number or not decision.get("kept_configured"):
        return best
    return TunedParams(best.key, dict(decision["configured_params"]), float(decision["configured_ne"]), -1, best.study_name)


def trial_seeds_ne(trial: FrozenTrial) -> tuple[float, ...]:
    """A finished trial's validation NE per training seed, in seed order (flows/tuning/trials.py
    records them); empty for a trial of one seed."""
    per_seed = trial.user_attrs.get("ne_per_seed", {})
    return tuple(float(per_seed[seed]) for seed in sorted(per_seed, key=int)) if len(per_seed) > 1 else ()


def trial_params(trial: FrozenTrial) -> Params:
    """What a finished trial trained with: the sampled parameters and those it chose itself
    (the epoch count early stopping settled on)."""
    return {**trial.params, **trial.user_attrs.get("chosen", {})}


def tuned_keys(storage: RDBStorage, model: str) -> list[TunedParams]:
    """The best parameters of every tuned key of `model` in this storage."""
    found = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=True):
        attrs = summary.user_attrs
        best: FrozenTrial | None = summary.best_trial
        if attrs.get("model") != model or "tuning_key" not in attrs or best is None or best.value is None:
            continue
        found.append(_as_judged(_tuned(attrs, best, summary.study_name), attrs))
    return found


def _key_of(attrs: dict[str, Any]) -> TuningKey:
    return TuningKey(**attrs["tuning_key"])
