"""A fresh run on few rows starts as its logistic regression (`model.regression_start = "auto"`).

On a few thousand rows a DLRM's embeddings are mostly noise: most ids are seen a handful of
times, and a few epochs of SGD teach them less than L-BFGS with a validated L2 teaches the
ids' own weights of a logistic regression. Measured with three seeds (docs/run-length.md): on
Avazu's 8,000 rows the plain DLRM stayed 0.8 % behind the fitted regression (NE 0.9127 mean,
0.42 % seed spread), while a wide DLRM started at that regression, with small steps for the
embeddings so that the ids' weights stay near the regression's optimum, finished ahead of it
(0.8992, 0.29 % spread). On MovieLens's 66,000 rows the plain DLRM wins by 3 % and the
regression start only keeps the regression. So a run with fewer than `FEW_ROWS` training
rows gets the regression start; more rows, the model as configured.

What it changes, each said in the run's resolved changes:
- a fresh run: `model.wide = true`, `model.wide_start = "logistic_regression"`,
  `training.embedding_lr` at most `EMBEDDING_LR`, and a tuner's range for that rate at most
  `SEARCHED_EMBEDDING_LR` (the default range, 0.005–1, would search only rates that move the
  ids' weights off the regression: on a 25,000-row warehouse every trial of it ended worse
  than the click rate);
- a night continuing a model that this rule started at the regression: the same
  `training.embedding_lr` ceiling (the ids' weights would otherwise drift from the
  regression's optimum night after night), unless a tuned rate is given; the shape is the
  champion's anyway.

It leaves alone a config that asks for a wide model itself (its own start and rates), another
architecture (only the dot interaction has a wide part), and managed ids (their rows are
admitted ids, not the regression's hashed ones: the start would be zero).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ingestion.config import FEW_ROWS  # fewer training rows than this start at the regression
from training.config import ModelConfig, TrainingConfig
from training.tuning.config import TuningConfig

EMBEDDING_LR = 0.005  # the embeddings' steps under a regression start (0.05 moved an id's weight off it in a step)
# The tuner's range for that rate under a regression start: the one that tuned
# configs/small-real.toml level with its regression
SEARCHED_EMBEDDING_LR = (0.0001, 0.01)


@dataclass(frozen=True)
class RunSettings:
    """The parts of a run's config the rule reads and writes."""

    model: ModelConfig
    training: TrainingConfig
    tuning: TuningConfig


def applies(model: ModelConfig, categorical_mode: str) -> bool:
    """Whether the rule may change this configured model at all (see the module)."""
    return (model.regression_start == "auto" and not model.wide and model.arch == "dlrm"
            and categorical_mode != "managed")  # fmt: skip


def fit_regression_start(settings: RunSettings, rows: int, categorical_mode: str) -> tuple[RunSettings, str | None]:
    """A fresh run's settings under the rule (see the module), and the change said; unchanged
    (and None) when the rule leaves them."""
    model = settings.model
    if not applies(model, categorical_mode) or rows >= FEW_ROWS:
        return settings, None
    started = dataclasses.replace(model, wide=True, wide_start="logistic_regression")
    slower, rate = _small_steps(settings.training)
    tuning, searched = _small_search(settings.tuning)
    return RunSettings(started, slower, tuning), (
        f"model.wide false → true; model.wide_start \"zero\" → \"logistic_regression\"{rate}{searched}: {rows:,} "
        f"training rows are fewer than {FEW_ROWS:,}, on which a DLRM started as the fitted logistic regression beats "
        "the plain one; set model.regression_start = \"configured\" to train the model as configured")  # fmt: skip


def continue_regression_start(configured: ModelConfig, champion: ModelConfig, training: TrainingConfig,
                              categorical_mode: str) -> tuple[TrainingConfig, str | None]:  # fmt: skip
    """A night continuing `champion`: the rule's embedding steps when the rule started it (the
    configured model is the rule's to change and the champion is a regression-started wide
    model), and the change said."""
    if not (applies(configured, categorical_mode) and champion.wide and champion.wide_start == "logistic_regression"):
        return training, None
    slower, rate = _small_steps(training)
    if not rate:
        return training, None
    return slower, (f"{rate.removeprefix('; ')}: the champion was started as the logistic regression "
                    "(model.regression_start = \"auto\"), and larger steps move its ids' weights off it")  # fmt: skip


def _small_search(tuning: TuningConfig) -> tuple[TuningConfig, str]:
    low, high = tuning.embedding_lr
    if high <= SEARCHED_EMBEDDING_LR[1]:
        return tuning, ""
    return (dataclasses.replace(tuning, embedding_lr=SEARCHED_EMBEDDING_LR),
            f"; tuning.embedding_lr {[low, high]} → {list(SEARCHED_EMBEDDING_LR)}")  # fmt: skip


def _small_steps(training: TrainingConfig) -> tuple[TrainingConfig, str]:
    if training.embedding_lr <= EMBEDDING_LR:
        return training, ""
    return (dataclasses.replace(training, embedding_lr=EMBEDDING_LR),
            f"; training.embedding_lr {training.embedding_lr} → {EMBEDDING_LR}")  # fmt: skip
