"""A fresh run on few rows starts as its logistic regression (`model.regression_start = "auto"`),
and a night continuing such a model keeps its small embedding steps; what the rule leaves alone."""

import pytest

from training.config import ModelConfig, TrainingConfig
from training.model.small_data import (
    EMBEDDING_LR,
    FEW_ROWS,
    SEARCHED_EMBEDDING_LR,
    RunSettings,
    continue_regression_start,
    fit_regression_start,
)
from training.tuning.config import TuningConfig

DEFAULTS = RunSettings(ModelConfig(), TrainingConfig(), TuningConfig())


def _fit(rows: int, mode: str = "hash", model: ModelConfig | None = None, training: TrainingConfig | None = None,
         tuning: TuningConfig | None = None) -> tuple[RunSettings, str | None]:  # fmt: skip
    return fit_regression_start(RunSettings(model or ModelConfig(), training or TrainingConfig(), tuning or TuningConfig()),
                                rows, mode)  # fmt: skip


def test_few_rows_start_a_wide_model_at_the_regression_with_small_embedding_steps() -> None:
    settings, note = _fit(8_000)
    assert settings.model.wide and settings.model.wide_start == "logistic_regression"
    assert settings.training.embedding_lr == EMBEDDING_LR and TrainingConfig().embedding_lr > EMBEDDING_LR
    assert note is not None and "8,000 training rows" in note and "training.embedding_lr 0.05 → 0.005" in note
    assert 'model.regression_start = "configured"' in note, "the note says how to keep the model as configured"
    assert settings.training.dense_lr == TrainingConfig().dense_lr, "only the embeddings' steps change"


def test_the_tuner_searches_embedding_rates_that_keep_the_start() -> None:
    settings, note = _fit(8_000)
    assert settings.tuning.embedding_lr == SEARCHED_EMBEDDING_LR and TuningConfig().embedding_lr[1] > SEARCHED_EMBEDDING_LR[1]
    assert note is not None and "tuning.embedding_lr [0.005, 1.0] → [0.0001, 0.01]" in note
    small = TuningConfig(embedding_lr=(0.0002, 0.002))
    assert _fit(8_000, tuning=small)[0].tuning == small, "a range already within it is kept"
    assert settings.tuning.dense_lr == TuningConfig().dense_lr


def test_vocab_tables_start_at_the_regression_too() -> None:
    assert _fit(1_000, "vocab")[0].model.wide


def test_a_configured_rate_below_the_ceiling_is_kept() -> None:
    slow = TrainingConfig(embedding_lr=0.001)
    settings, note = _fit(8_000, training=slow)
    assert settings.model.wide and settings.training == slow and note is not None and "training.embedding_lr" not in note


@pytest.mark.parametrize("rows", [FEW_ROWS, 68_000, 600_000])
def test_enough_rows_train_the_model_as_configured(rows: int) -> None:
    assert _fit(rows) == (DEFAULTS, None)
    assert _fit(FEW_ROWS - 1)[1] is not None


@pytest.mark.parametrize(("model", "mode"), [
    (ModelConfig(regression_start="configured"), "hash"),
    (ModelConfig(wide=True), "hash"),  # a wide model asked for: its own start and rates
    (ModelConfig(arch="dlrm_dcn"), "hash"),  # no wide part
    (ModelConfig(), "managed"),  # admitted ids' rows, not the regression's hashed ones
])  # fmt: skip
def test_what_the_rule_leaves_alone(model: ModelConfig, mode: str) -> None:
    assert _fit(1_000, mode, model) == (RunSettings(model, TrainingConfig(), TuningConfig()), None)


def test_a_night_continuing_a_regression_started_champion_keeps_its_small_steps() -> None:
    champion = _fit(8_000)[0].model
    training, note = continue_regression_start(ModelConfig(), champion, TrainingConfig(), "hash")
    assert training.embedding_lr == EMBEDDING_LR and note is not None and "logistic regression" in note
    assert continue_regression_start(ModelConfig(), ModelConfig(), TrainingConfig(), "hash") == (TrainingConfig(), None), \
        "a plain champion trains at the configured rate"
    explicit = ModelConfig(wide=True, wide_start="logistic_regression")
    assert continue_regression_start(explicit, champion, TrainingConfig(), "hash") == (TrainingConfig(), None), \
        "a config that asks for the wide start itself keeps its own rate"
    assert continue_regression_start(ModelConfig(regression_start="configured"), champion, TrainingConfig(), "hash") == \
        (TrainingConfig(), None)
