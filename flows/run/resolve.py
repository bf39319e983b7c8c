"""A run resolved once: the settings every later step of a run reads, in one frozen object.

The configured run changes here and nowhere else, in this order, each change said with its
reason:

1. the night (`dlrm run --as-of N`): its training days, day N as the evaluation day, and no
   second warm-up for a warm start (flows/run/nights.py);
2. on a fresh run with the preprocessing state known, the categorical mode it fitted
   (`preprocess.categorical_mode = "auto"`: a vocabulary on few rows, ingestion/config.py),
   the MLP widths the training rows support (`model.mlp_width = "auto"`,
   training/model/width.py), before the tuner's width factor applies to them; and on few
   rows, a start as the logistic regression
   (`model.regression_start = "auto"`, training/model/small_data.py), before a tuned
   embedding rate applies;
3. the hyperparameters the tuning decision chose (flows/tuning/hyperparameters.py);
4. the champion's model shape and preprocessing mode (`preprocess.categorical_mode`), which a
   warm start keeps whatever the config or the tuner say; and for a champion the rule of
   step 2 started as the regression, its small embedding steps;
5. the run length, fitted last so that it sees any tuned batch: the global batch is halved
   until the run has `training.min_steps` steps (training/loop/run_length.py);
6. with that length known, a study's batch sizes (`tuning.batch_sizes = "auto"`): the
   run's batch, its half and its quarter (training/tuning/space.py, `search_batches`).

The tuning key is then taken from the result, so the key, the training job, the summary and
MLflow all name the batch and the workers the run trains with. A run is resolved in stages
as its inputs become known: the night's days (to prepare the data), then with the
preprocessing state (the key the tuning decision looks up), then with the decision (the run).
Each stage is this same function from the configured values, never a rewrite of a result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flows.run.config import PipelineConfig, trainer_cluster
from flows.run.nights import Night, night_config, with_champion_preprocessing, with_champion_shape
from ingestion.config import FEW_ROWS
from ingestion.preprocess import PreprocessState
from training.config import Workers
from training.loop.run_length import fit_run_length
from training.model.small_data import RunSettings, continue_regression_start, fit_regression_start
from training.model.width import fit_mlp_width
from training.tuning.key import TuningKey, tuning_key
from training.tuning.space import apply_params, search_batches
from training.tuning.trigger import TuningDecision


@dataclass(frozen=True)
class Change:
    """One rewrite of the configured run: which step made it, and what it changed and why."""

    step: str  # "night", "preprocessing mode", "model width", "regression start", "tuning", "champion shape",
    # "champion preprocessing", "run length", "tuning key"
    note: str


@dataclass(frozen=True)
class ResolvedRun:
    config: PipelineConfig  # what every later step reads
    night: Night
    key: TuningKey  # of the batch, workers and hardware the run trains with
    steps: int | None  # optimizer steps; None before the data is known
    tuning: TuningDecision | None  # None before the decision is made (or for a run that takes none)
    changes: tuple[Change, ...]

    @property
    def workers(self) -> Workers:
        return self.config.workers

    def change_lines(self) -> list[str]:
        """Each change to the configured run, as a line of the log."""
        return [f"resolved run: {change.step}: {change.note}" for change in self.changes]


def resolve_run(config: PipelineConfig, night: Night | None = None, state: PreprocessState | None = None,
                tuning: TuningDecision | None = None) -> ResolvedRun:  # fmt: skip
    """The run of the configured `config` (see the module for the order)."""
    night = night or Night.plain(config)
    changes: list[Change] = []

    def apply(step: str, changed: tuple[PipelineConfig, str | None]) -> PipelineConfig:
        result, note = changed
        if note:
            changes.append(Change(step, note))
        return result

    config = apply("night", night_config(config, night))
    if state is not None and night.warm_start is None:
        config = apply("preprocessing mode", _with_fitted_mode(config, state))
        model, note = fit_mlp_width(config.model, state.train_rows)
        config = apply("model width", (dataclasses.replace(config, model=model), note))
        settings, note = fit_regression_start(RunSettings(config.model, config.training, config.tuning), state.train_rows,
                                              state.mode)  # fmt: skip
        started = dataclasses.replace(config, model=settings.model, training=settings.training, tuning=settings.tuning)
        config = apply("regression start", (started, note))
    if tuning is not None:
        config = apply("tuning", _with_tuned(config, tuning))
    if night.warm_start is not None:
        configured = config.model
        config = apply("champion shape", with_champion_shape(config, night.warm_start))
        config = apply("champion preprocessing", with_champion_preprocessing(config, night.warm_start))
        if tuning is None or "training.embedding_lr" not in tuning.params:  # a tuned rate wins, as on a fresh run
            training, note = continue_regression_start(configured, config.model, config.training,
                                                       config.preprocess.categorical_mode)  # fmt: skip
            config = apply("regression start", (dataclasses.replace(config, training=training), note))
    steps = None
    if state is not None:
        fitted = fit_run_length(config.training, state.train_rows, config.workers)
        config = apply("run length", (dataclasses.replace(config, training=fitted.training), fitted.note))
        steps = fitted.steps
        if config.tuning.batch_sizes == "auto":
            config = apply("search batches", _with_search_batches(config))
    key = tuning_key(config.training, config.workers, trainer_cluster(config))
    if tuning is not None and key != tuning.key:
        changes.append(Change("tuning key", f"the run trains at batch {key.global_batch_size:,}, so its key is "
                              f"{key.fingerprint} (its parameters came by key {tuning.key.fingerprint})"))  # fmt: skip
    return ResolvedRun(config, night, key, steps, tuning, tuple(changes))


def _with_fitted_mode(config: PipelineConfig, state: PreprocessState) -> tuple[PipelineConfig, str]:
    """`preprocess.categorical_mode = "auto"` as the fitted state resolved it (by its rows), so
    that the job, MLflow and the summary name the mode trained; the state's id is that mode's."""
    if config.preprocess.categorical_mode != "auto" or state.mode == "auto":
        return config, ""
    preprocess = dataclasses.replace(config.preprocess, categorical_mode=state.mode)
    if state.mode == "vocab":
        why = (f"{state.train_rows:,} training rows are fewer than {FEW_ROWS:,}: every id they saw has a row of its own "
               "and an id they never saw the out-of-vocabulary row, whose weight no training row moves, as in a one-hot "
               "regression; set preprocess.categorical_mode = \"hash\" to hash them")  # fmt: skip
    elif state.train_rows >= FEW_ROWS:
        why = f"{state.train_rows:,} training rows are not fewer than {FEW_ROWS:,}"
    else:  # few rows, but the config asks for tables a vocabulary cannot size (PreprocessConfig.mode_for)
        asked = config.preprocess
        why = f'preprocess.table_rows = "{asked.table_rows}" and hash_size {asked.hash_size} ask for hash tables'
    return dataclasses.replace(config, preprocess=preprocess), f'preprocess.categorical_mode "auto" → "{state.mode}": {why}'


def _with_search_batches(config: PipelineConfig) -> tuple[PipelineConfig, str]:
    batches = search_batches(config.training.batch_size, config.workers.world_size)
    tuning = dataclasses.replace(config.tuning, batch_sizes=batches)
    return dataclasses.replace(config, tuning=tuning), ""  # the study says what it searches


def _with_tuned(config: PipelineConfig, tuning: TuningDecision) -> tuple[PipelineConfig, str]:
    training, model = apply_params(config.training, config.model, tuning.params)
    tuned = dataclasses.replace(config, training=training, model=model)
    changed = [f"{section}.{f.name} {getattr(getattr(config, section), f.name)!r} → "
               f"{getattr(getattr(tuned, section), f.name)!r}"
               for section in ("training", "model") for f in dataclasses.fields(getattr(config, section))
               if getattr(getattr(config, section), f.name) != getattr(getattr(tuned, section), f.name)]  # fmt: skip
    return tuned, f"{tuning.action}: {'; '.join(changed)}" if changed else ""
