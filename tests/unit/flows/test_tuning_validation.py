"""Which rows a study scores its trials on: progressive validation (the newest training days)
on a dated warehouse, a random slice of rows otherwise, the configured days always first."""

from pathlib import Path

import pytest

from flows.run.config import ConfigError, load_config
from flows.tuning.trials import validation_days
from ingestion.days import parse_day

ROOT = Path(__file__).resolve().parents[3]
DATED = ROOT / "configs" / "warehouse-example.toml"  # ds=2026-11-17 … partitions
TINY = ROOT / "configs" / "tiny.toml"  # integer days


def test_a_dated_warehouse_scores_trials_on_its_newest_training_day() -> None:
    config = load_config(DATED)
    assert config.data.dated and len(config.data.train_days) > 1
    assert validation_days(config) == (max(config.data.train_days),)
    two = load_config(DATED, ["tuning.validation_newest_days=2"])
    assert validation_days(two) == tuple(sorted(config.data.train_days)[-2:])


def test_integer_days_keep_a_random_slice_unless_asked() -> None:
    assert validation_days(load_config(TINY)) == ()
    assert validation_days(load_config(TINY, ['tuning.validation="newest_days"'])) == (1,)
    assert validation_days(load_config(DATED, ['tuning.validation="random"'])) == ()


def test_configured_validation_days_win() -> None:
    config = load_config(DATED)
    first = min(config.data.train_days)
    shown = config.data.shown(first)
    chosen = load_config(DATED, [f'tuning.validation_days=["{shown}"]'])
    assert validation_days(chosen) == (parse_day(shown),)


def test_newest_days_that_leave_no_day_to_train_on_are_one_line() -> None:
    config = load_config(TINY, ['tuning.validation="newest_days"', "tuning.validation_newest_days=2"])
    with pytest.raises(ConfigError, match="leave no day to train trials on"):
        validation_days(config)


def test_small_data_scores_trials_on_three_folds_unless_told() -> None:
    from flows.tuning.trials import fold_count

    config = load_config(TINY, ["tuning.validation_folds=0"])
    assert fold_count(config, train_rows=12_000) == 3 and fold_count(config, train_rows=600_000) == 1
    assert fold_count(load_config(TINY, ["tuning.validation_folds=0", "tuning.validation_percent=40"]), 12_000) == 2
    assert fold_count(load_config(TINY), 12_000) == 1  # tiny.toml asks for one
    with pytest.raises(ConfigError, match="validation_folds"):
        load_config(TINY, ["tuning.validation_folds=11"])  # 11 slices of 10 % do not fit
