"""The tuner's pruner reads held-out NE from the job's typed metrics records."""

import logging

import optuna
import pytest

from flows.run.feature_files import Features
from flows.tuning.trials import EpochEnds, StopEarly, TrainingTrial
from training.loop.progress import HeldoutRecord, TrainRecord


class _TrialRun:
    """Stands in for a trial's MLflow run (flows/tracking/studies.TrialRun): what it was asked to log."""

    def __init__(self) -> None:
        self.logged: list[tuple] = []

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        self.logged.append((key, value, step))


def _trial_after_a_good_one() -> optuna.Trial:
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0))
    good = study.ask()
    good.report(0.80, 50)
    study.tell(good, 0.80)
    return study.ask()


def test_a_heldout_record_worse_than_the_median_prunes_the_trial() -> None:
    run = _TrialRun()
    watch = TrainingTrial(None, None, None, "parent", None, logging.getLogger(__name__))  # type: ignore[arg-type]
    trial = _trial_after_a_good_one()
    record = TrainRecord(23, 46, 5888, 0.5, 0.9, 0.9, 1e4, 1.0, steps_per_epoch=46)
    watch._on_progress(trial, run, record, metric="heldout_ne", prune=True)
    assert run.logged == [], "training records do not feed the pruner"
    watch._on_progress(trial, run, HeldoutRecord(10, 46, 2560, 0.99, steps_per_epoch=46), metric="heldout_ne", prune=False)
    assert run.logged == [("heldout_ne", 0.99, 10)], "logged, not reported, for a later seed"
    with pytest.raises(optuna.TrialPruned, match="at step 23/46 is worse than the median"):
        watch._on_progress(trial, run, HeldoutRecord(23, 46, 5888, 0.95, steps_per_epoch=46), metric="heldout_ne", prune=True)
    assert trial.storage.get_trial(trial._trial_id).intermediate_values == {50: 0.95}, "reported at % done"


def test_a_diverged_heldout_ne_prunes_the_trial() -> None:
    watch = TrainingTrial(None, None, None, "parent", None, logging.getLogger(__name__))  # type: ignore[arg-type]
    with pytest.raises(optuna.TrialPruned, match="diverged"):
        watch._on_progress(_trial_after_a_good_one(), _TrialRun(), HeldoutRecord(5, 46, 1280, float("nan"), steps_per_epoch=46),
                           metric="heldout_ne", prune=True)  # fmt: skip


def test_the_last_heldout_record_is_logged_but_never_prunes() -> None:
    run = _TrialRun()
    watch = TrainingTrial(None, None, None, "parent", None, logging.getLogger(__name__))  # type: ignore[arg-type]
    trial = _trial_after_a_good_one()
    watch._on_progress(trial, run, HeldoutRecord(46, 46, 11776, 0.99, steps_per_epoch=46), metric="heldout_ne", prune=True)
    assert run.logged == [("heldout_ne", 0.99, 46)]
    assert trial.storage.get_trial(trial._trial_id).intermediate_values == {}, "not reported: the trial is done"


def test_a_trial_that_learns_nothing_is_discarded_at_its_first_report_past_the_warm_up() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(tuning=SimpleNamespace(prune_after_pct=30))
    watch = TrainingTrial(config, None, None, "parent", None, logging.getLogger(__name__))  # type: ignore[arg-type]
    run = _TrialRun()
    trial = optuna.create_study(pruner=optuna.pruners.NopPruner()).ask()
    watch._on_progress(trial, run, HeldoutRecord(10, 46, 2560, 1.02, steps_per_epoch=46), metric="heldout_ne", prune=True)
    with pytest.raises(optuna.TrialPruned, match="no better than the click rate"):
        watch._on_progress(trial, run, HeldoutRecord(20, 46, 5120, 1.001, steps_per_epoch=46), metric="heldout_ne", prune=True)
    watch._on_progress(trial, run, HeldoutRecord(20, 46, 5120, 0.999, steps_per_epoch=46), metric="heldout_ne", prune=True)


def test_early_stopping_stops_when_an_epoch_end_is_worse_and_keeps_the_best_epoch() -> None:
    ends = EpochEnds(max_epochs=3)
    assert not ends.rose(HeldoutRecord(5, 30, 1, 0.95, steps_per_epoch=10)), "not an epoch end"
    assert not ends.rose(HeldoutRecord(10, 30, 1, 0.90, steps_per_epoch=10))
    assert not ends.rose(HeldoutRecord(20, 30, 1, 0.88, steps_per_epoch=10))
    assert ends.rose(HeldoutRecord(30, 30, 1, 0.89, steps_per_epoch=10))
    assert ends.ne == [0.90, 0.88, 0.89] and ends.best() == (2, 0.88)
    single = EpochEnds(max_epochs=1)
    assert not single.rose(HeldoutRecord(30, 30, 1, 0.89, steps_per_epoch=10)) and not single.early_stopping


def test_a_watched_epoch_end_that_rose_stops_the_run() -> None:
    watch = TrainingTrial(None, None, None, "parent", None, logging.getLogger(__name__))  # type: ignore[arg-type]
    ends, trial, run = EpochEnds(max_epochs=2), _trial_after_a_good_one(), _TrialRun()
    first = HeldoutRecord(10, 20, 1, 0.85, steps_per_epoch=10)
    watch._on_progress(trial, run, first, metric="heldout_ne", prune=False, epochs=ends)
    with pytest.raises(StopEarly):
        second = HeldoutRecord(20, 20, 1, 0.86, steps_per_epoch=10)
        watch._on_progress(trial, run, second, metric="heldout_ne", prune=False, epochs=ends)


def test_early_stopping_trials_run_the_most_epochs_scored_on_every_validation_row(tiny_features, tmp_path) -> None:
    from flows.run.config import load_config
    from flows.tuning.trials import tuning_data, validation_job

    state, files = tiny_features
    config = load_config("configs/tiny.toml", [f'run_dir="{tmp_path}"', "tuning.max_epochs=3", "training.epochs=1"])
    data = tuning_data(config, Features(state, files, []))
    plain = validation_job(config, data, {}, tmp_path / "plain")
    stopping = validation_job(config, data, {}, tmp_path / "stopping", early_stopping=True)
    assert (plain.training.epochs, plain.evaluation.heldout_every_epoch) == (1, False)
    assert (stopping.training.epochs, stopping.evaluation.heldout_every_epoch) == (3, True)
    assert stopping.evaluation.heldout_batches == 0, "every validation row"


def test_trials_validate_on_a_slice_of_the_training_rows_never_the_evaluation_days(tiny_features, tmp_path) -> None:
    from flows.run.config import load_config
    from flows.tuning.trials import tuning_data

    state, files = tiny_features
    config = load_config("configs/tiny.toml", [f'run_dir="{tmp_path}"'])
    features = Features(state, files, [])
    data = tuning_data(config, features)
    training = set(files[0] + files[1])
    assert list(data.validation_files) == ["holdout"] and not set(data.train_files) & set(files[2])
    assert not set(data.validation_files["holdout"]) & set(files[2]), "never the evaluation day"
    assert not set(data.train_files) & training, "trials train on the fit part, not the whole days"
    by_day = tuning_data(load_config("configs/tiny.toml", [f'run_dir="{tmp_path}"', "tuning.validation_days=[1]"]),
                         features)  # fmt: skip
    assert by_day.train_files == tuple(files[0]) and by_day.validation_files == {"1": tuple(files[1])}


def test_validating_on_an_evaluation_day_is_refused() -> None:
    from flows.run.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tuning.validation_days: .*never on the evaluation days"):
        load_config("configs/tiny.toml", ["tuning.validation_days=[2]"])


def test_the_retune_command_runs_inside_the_retune_flow() -> None:
    """`dlrm retune` calls `retune_of`: it must be the Prefect flow (its run is what a stop
    marks Cancelled and what the UI lists), and helpers beside it plain functions."""
    from prefect import Flow

    from flows.tuning.retune import budget_text, retune, retune_of

    assert isinstance(retune_of, Flow) and retune_of.name == "retune"
    assert isinstance(retune, Flow) and retune.name == "retune"
    assert not isinstance(budget_text, Flow)
