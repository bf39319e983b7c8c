"""Studies: exact budgets, warm starts, resuming after a killed worker, and two workers
sharing one study on the local PostgreSQL.

The objective here is a cheap analytic function of the suggested parameters: what is
under test is how trials are claimed, counted and recovered, not training.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from training.tuning.config import TuningConfig
from training.tuning.key import TuningKey
from training.tuning.space import suggest
from training.tuning.study import (
    TunedParams,
    best_of,
    enqueue_warm_start,
    join_as_worker,
    open_storage,
    open_study,
    run_worker,
    tuned_keys,
)

ROOT = Path(__file__).resolve().parents[4]
POSTGRES_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
KEY = TuningKey(2048, 2, 1, "cpu", "EPYC", 12)


def bowl(trial: optuna.Trial, delay: float = 0.0) -> float:
    """Smallest at embedding_lr = 0.1, dense_lr = 0.01; reports two steps for the pruner.
    `delay` stands for training time, after the parameters are chosen."""
    params = suggest(trial, TuningConfig(batch_sizes=()))
    time.sleep(delay)
    value = (math.log10(params["training.embedding_lr"]) + 1) ** 2 + (math.log10(params["training.dense_lr"]) + 2) ** 2
    for percent in (50, 100):
        trial.report(value + 50 / percent, percent)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return value


def _study(url: str, space: TuningConfig, model: str = "m", key: TuningKey = KEY) -> tuple[optuna.Study, int]:
    study = open_study(open_storage(url, space.heartbeat_s), model, key, space)
    return study, join_as_worker(study, url, space)


def test_one_worker_runs_exactly_the_budget_and_finds_the_bowl(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    space = TuningConfig(n_trials=14, batch_sizes=(), sampler="tpe", seed=1)
    study, worker = _study(url, space)
    outcome = run_worker(study, bowl, space, url, worker)
    counted = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(counted) == len(outcome.trials_run) == 14 and outcome.stopped_by == "budget"
    assert run_worker(study, bowl, space, url, worker).trials_run == [], "a spent budget runs nothing more"
    best = best_of(study)
    assert best is not None and best.ne == min(t.value for t in study.trials if t.state == TrialState.COMPLETE)
    assert best.key == KEY
    assert [t.study_name for t in tuned_keys(open_storage(url, 10), "m")] == [study.study_name]
    assert tuned_keys(open_storage(url, 10), "another-model") == []


def test_the_best_trial_carries_its_ne_per_seed_and_their_spread(tmp_path: Path) -> None:
    """What flows/tuning/trials.py records per seed comes back with the best trial, in seed
    order (10 before 9 as text, not as numbers), for the run's summary; one seed: no spread."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    space = TuningConfig(n_trials=3, batch_sizes=(), sampler="tpe", seed=1)
    study, worker = _study(url, space)

    def seeded(trial: optuna.Trial) -> float:
        value = bowl(trial)
        per_seed = {"9": value * 0.99, "10": value * 1.01} if trial.number != 2 else {"9": value}
        trial.set_user_attr("ne_per_seed", per_seed)
        return value

    run_worker(study, seeded, space, url, worker)
    best = best_of(study)
    assert best is not None
    trial = study.trials[best.trial_number]
    if best.trial_number == 2:
        assert best.ne_per_seed == () and best.seed_spread is None
    else:
        assert best.ne_per_seed == pytest.approx((trial.value * 0.99, trial.value * 1.01))
        assert best.seed_spread == pytest.approx(0.02 / 0.99)
    (listed,) = tuned_keys(open_storage(url, 10), "m")
    assert listed.ne_per_seed == best.ne_per_seed
    assert TunedParams(KEY, {}, 0.9, 0, "s", (0.9,)).seed_spread is None


def test_a_timeout_alone_runs_trials_until_the_time_is_up(tmp_path: Path) -> None:
    """`dlrm retune --timeout S` without `--trials`: the config's count is dropped (the
    command wins), and the study runs trials until S."""
    from training.tuning.config import budget_overrides

    assert budget_overrides(None, 2.0) == ["tuning.timeout_s=2.0", "tuning.n_trials=0"]
    assert budget_overrides(5, None) == ["tuning.n_trials=5"], "a count alone keeps the config's timeout"
    assert budget_overrides(5, 2.0) == ["tuning.n_trials=5", "tuning.timeout_s=2.0"], "both: the first reached"
    with pytest.raises(ValueError, match="0 \\(no count\\) with a timeout_s"):
        TuningConfig(n_trials=0)
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    space = TuningConfig(n_trials=0, timeout_s=2.0, batch_sizes=(), sampler="tpe", seed=1)
    study, worker = _study(url, space)
    started = time.monotonic()
    outcome = run_worker(study, lambda trial: bowl(trial, delay=0.1), space, url, worker)
    elapsed = time.monotonic() - started
    # The deadline is checked before each claim, so the study ends within one trial of it;
    # how many trials fit depends on the machine's load (3 on a loaded CI host, 15 idle).
    assert outcome.stopped_by == "timeout" and 2.0 <= elapsed < 2.0 + 10.0
    assert len(outcome.trials_run) >= 2, "trials ran until the time was up, not to a count"
    assert outcome.trials_run == list(range(len(outcome.trials_run)))


def test_warm_start_queues_the_nearest_best_scaled_by_both_rules_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    space = TuningConfig(n_trials=5, batch_sizes=(), seed=2)
    small = TuningKey(256, 2, 1, "cpu", "EPYC", 12)
    nearest = TunedParams(small, {"training.embedding_lr": 0.02, "training.dense_lr": 0.001,
                                  "training.warmup_fraction": 0.05, "training.lr_decay": "cosine",
                                  "training.embedding_eps": 1e-8, "training.dense_weight_decay": 1e-6,
                                  "training.embedding_weight_decay": 1e-6},
                          0.8, 4, "m.small")  # fmt: skip
    study, worker = _study(url, space)
    assert enqueue_warm_start(study, url, nearest, KEY.global_batch_size, space) == 4
    assert enqueue_warm_start(study, url, nearest, KEY.global_batch_size, space) == 0, "only once per study"
    run_worker(study, bowl, space, url, worker)
    first, second, third, fourth = sorted(study.trials, key=lambda t: t.number)[:4]
    assert first.params["training.embedding_lr"] == pytest.approx(0.02 * 8**0.5)  # √ rule
    assert first.params["training.dense_lr"] == pytest.approx(0.001 * 8**0.5)
    assert second.params["training.embedding_lr"] == pytest.approx(0.02 * 8)  # linear rule
    assert second.params["training.dense_lr"] == pytest.approx(0.001 * 8)
    assert third.params["training.embedding_lr"] == pytest.approx(0.02 * 8)  # linear for embeddings,
    assert third.params["training.dense_lr"] == pytest.approx(0.001 * 8**0.5)  # √ for the dense layers
    assert fourth.params == nearest.params, "and the tuned point itself, unscaled"
    assert first.params["training.warmup_fraction"] == 0.05 and first.params["training.lr_decay"] == "cosine"
    assert first.user_attrs["warm_start"] == "m.small#4"


WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.unit.training.tuning.test_tuning_study import bowl, _study
    from training.tuning.config import TuningConfig
    from training.tuning.study import run_worker

    def slow_bowl(trial):
        return bowl(trial, delay={sleep})

    space = TuningConfig(n_trials={n_trials}, batch_sizes=(), sampler="tpe", seed=4, heartbeat_s=1)
    study, worker = _study({url!r}, space, model={model!r})
    outcome = run_worker(study, slow_bowl, space, {url!r}, worker)
    print("RAN", worker, outcome.trials_run, flush=True)
    """
)


def _worker(url: str, model: str, n_trials: int, sleep: float) -> subprocess.Popen:
    code = WORKER.format(root=str(ROOT), url=url, model=model, n_trials=n_trials, sleep=sleep)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_a_study_resumes_after_its_worker_is_killed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    process = _worker(url, "m", n_trials=6, sleep=1.0)
    storage = open_storage(url, 1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill it in the middle of its third trial
        studies = optuna.get_all_study_summaries(storage)
        trials = optuna.load_study(study_name=studies[0].study_name, storage=storage).trials if studies else []
        if trials:  # the study exists a moment before its first trial
            running = trials[-1]
            if sum(t.state == TrialState.COMPLETE for t in trials) >= 2 and running.state == TrialState.RUNNING \
                    and len(running.params) == 7:  # its parameters are chosen: it is training
                break
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed = optuna.load_study(study_name=studies[0].study_name, storage=storage)
    interrupted = [t for t in killed.trials if t.state == TrialState.RUNNING]
    assert len(interrupted) == 1, "one trial was cut off mid-run"

    time.sleep(5.0)  # well past the grace period (3 heartbeats): the dead worker's trial is stale
    space = TuningConfig(n_trials=6, batch_sizes=(), sampler="tpe", seed=4, heartbeat_s=1)
    study, worker = _study(url, space)
    assert worker == 1, "the resumed run joins as a second worker"
    run_worker(study, bowl, space, url, worker)
    trials = study.get_trials()
    done = [(t.number, t.state.name, t.system_attrs) for t in trials]
    assert sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials) == 6, done
    assert [t.state for t in trials if t.number == interrupted[0].number] == [TrialState.FAIL]
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == interrupted[0].number]
    assert len(retried) == 1 and retried[0].params == interrupted[0].params, "its parameters were run again"


@pytest.fixture
def postgres_url():
    """A fresh database on the local PostgreSQL, dropped afterwards."""
    import psycopg

    name = f"dlrm_test_optuna_{uuid.uuid4().hex[:8]}"
    try:
        admin = psycopg.connect(POSTGRES_ADMIN, autocommit=True)
    except psycopg.OperationalError as error:
        pytest.fail(f"the local PostgreSQL at 127.0.0.1:5432 is needed: {error}")
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.close()


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_two_workers_share_one_study_on_postgres_without_losing_or_repeating_trials(postgres_url: str) -> None:
    n_trials = 12
    open_study(open_storage(postgres_url, 1), "shared", KEY, TuningConfig(n_trials=n_trials))  # tables first
    workers = [_worker(postgres_url, "shared", n_trials, sleep=0.3) for _ in range(2)]
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-2000:]
    ran = {int(line.split()[1]): json.loads(line.split(" ", 2)[2]) for out, _ in outputs for line in out.splitlines()
           if line.startswith("RAN")}  # fmt: skip
    study = optuna.load_study(study_name=f"shared.{KEY.fingerprint}", storage=postgres_url)
    trials = study.get_trials()
    counted = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(counted) == n_trials, "the budget is exactly spent"
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], "none left hanging"
    assert sorted(ran[0] + ran[1]) == sorted(t.number for t in counted), "every trial ran once, by one worker"
    assert ran[0] and ran[1], "both workers took trials"
    assert len({json.dumps(t.params, sort_keys=True) for t in counted}) == n_trials, "no point was proposed twice"
    assert {t.user_attrs["worker"] for t in counted} == {0, 1}
