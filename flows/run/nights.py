"""What a night trains, as data: the days a run "as of day N" trains, the champion it
continues, and the config of that night. Finding the champion and its lineage in the
registry is tracking's (flows/tracking/lineage.py); this module only computes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flows.run.config import PipelineConfig
from flows.run.rows import holds_out_rows
from ingestion.days import parse_day
from ingestion.preprocess import PreprocessState
from training.config import ModelConfig
from training.loop.run_length import SMALLEST_PER_PROCESS


@dataclass(frozen=True)
class WarmStart:
    """The champion a run continues."""

    version: str
    run_id: str
    checkpoint: str
    lineage_days: tuple[int, ...]
    model: ModelConfig  # its shape: the run keeps it whatever the config or the tuner says
    state: PreprocessState


@dataclass(frozen=True)
class Night:
    """What a run as of day `as_of` does; `as_of` None: a plain run of the configured days."""

    as_of: int | None
    train_days: tuple[int, ...]
    warm_start: WarmStart | None = None
    skipped: str = ""  # why nothing trains; "" when it trains
    earlier_version: str | None = None  # a skipped night: the version that already covers it
    note: str = ""

    @classmethod
    def plain(cls, config: PipelineConfig) -> Night:
        """A run of the configured days, continuing nothing."""
        return cls(None, config.data.train_days)

    @property
    def warm_checkpoint(self) -> str:
        """The checkpoint the run continues ("": none)."""
        return self.warm_start.checkpoint if self.warm_start else ""

    @property
    def lineage_days(self) -> tuple[int, ...]:
        before = self.warm_start.lineage_days if self.warm_start else ()
        return tuple(sorted({*before, *self.train_days}))


class CatchUpError(RuntimeError):
    """A night would retrain more unseen days than `orchestration.max_catch_up_days`."""


def check_catch_up(config: PipelineConfig, champion: str, lineage: tuple[int, ...], unseen: tuple[int, ...],
                   as_of: int) -> None:  # fmt: skip
    """Stop a night whose champion has fallen more than the bound behind, in one line."""
    bound = config.orchestration.max_catch_up_days
    if not bound or len(unseen) <= bound:
        return
    day, days_of = config.data.shown, config.data.shown_days
    raise CatchUpError(
        f"as of day {day(as_of)} champion version {champion} (lineage up to day {day(max(lineage))}) has "
        f"{len(unseen)} unseen days {days_of(unseen)}, more than orchestration.max_catch_up_days = {bound}: "
        "the nights since were not promoted. Read their promotion_reason in MLflow, then promote a good version "
        "(alias 'champion') or run this night once with --set orchestration.max_catch_up_days=0"
    )


def night_config(config: PipelineConfig, night: Night) -> tuple[PipelineConfig, str]:
    """The config of a night: its training days, day N as the evaluation day, no second
    warm-up for a warm start (unless `training.warmup_on_warm_start`); and what changed, for
    the log. A plain run (no `as_of`) keeps the configured days."""
    if night.as_of is None:
        return config, ""
    validation = tuple(d for d in config.tuning.validation_days if d in night.train_days)
    if set(validation) >= set(night.train_days):
        validation = ()  # one training day: the trials validate on a slice of its rows
    training, day = config.training, config.data.shown
    changes = [f"training days {config.data.shown_days(night.train_days)}, evaluation day {day(night.as_of)}"]
    if night.warm_start and not training.warmup_on_warm_start and (training.warmup_steps or training.warmup_fraction):
        training = dataclasses.replace(training, warmup_steps=0, warmup_fraction=0.0)
        changes.append("no warm-up: it continues the champion's optimizer state (training.warmup_on_warm_start)")
    return dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, train_days=night.train_days, eval_days=(night.as_of,)),
        tuning=dataclasses.replace(config.tuning, validation_days=validation),
        training=training,
    ), "; ".join(changes)


def with_champion_shape(config: PipelineConfig, warm: WarmStart) -> tuple[PipelineConfig, str]:
    """The config with the champion's model shape; and what that changed, for the log."""
    if config.model == warm.model:
        return config, ""
    changed = [f"model.{f.name} {getattr(config.model, f.name)!r} → {getattr(warm.model, f.name)!r}"
               for f in dataclasses.fields(ModelConfig)
               if getattr(config.model, f.name) != getattr(warm.model, f.name)]  # fmt: skip
    return dataclasses.replace(config, model=warm.model), (
        f"a warm start keeps the champion's model shape, whatever the config or the tuner say: {'; '.join(changed)} "
        "(start a new lineage with `dlrm run` to train another shape)")  # fmt: skip


def with_champion_preprocessing(config: PipelineConfig, warm: WarmStart) -> tuple[PipelineConfig, str]:
    """The config with the champion's way of turning ids into rows (`preprocess.categorical_mode`):
    a warm start extends the champion's fitted state, whatever the config says, so every later
    step (the job, the planner, the summary) must read that mode; and what that changed."""
    mode = warm.state.mode
    if config.preprocess.categorical_mode == mode:
        return config, ""
    preprocess = dataclasses.replace(config.preprocess, categorical_mode=mode)
    return dataclasses.replace(config, preprocess=preprocess), (
        f"a warm start keeps the champion's preprocessing: preprocess.categorical_mode "
        f"{config.preprocess.categorical_mode!r} → {mode!r} (start a new lineage with `dlrm run` to change it)")  # fmt: skip


def tagged_day(value: str | None) -> int | None:
    """A day of a lineage tag (an ISO date or an integer; versions tagged before dates were
    shown hold integers, which read the same)."""
    return parse_day(value) if value else None


def tagged_days(value: str) -> tuple[int, ...]:
    return tuple(parse_day(day) for day in value.split(",") if day)


def night_min_rows(config: PipelineConfig) -> int:
    """The fewest new rows a night continuing the champion trains on (`orchestration.min_night_rows`;
    "auto": `training.min_steps` steps at the smallest batch the run-length rule allows, counted
    after the night's held-out rows)."""
    configured = config.orchestration.min_night_rows
    if configured != "auto":
        return int(configured)
    held_out = config.evaluation.calibration_percent / 100 if holds_out_rows(config) else 0.0
    smallest_batch = SMALLEST_PER_PROCESS * config.workers.world_size
    return math.ceil(config.training.min_steps * smallest_batch / (1.0 - held_out))


def waits_for_rows(config: PipelineConfig, night: Night, new_rows: int) -> str:
    """Why a night continuing the champion waits for more rows ("" when it trains): fewer new
    rows than `night_min_rows` train too few steps to improve it, and its few held-out rows
    choose the run length and fit the calibrator by chance."""
    least = night_min_rows(config)
    if night.warm_start is None or new_rows >= least:
        return ""
    days = config.data.shown_days(night.train_days)
    return (f"waiting for more rows: days {days} hold {new_rows:,} new rows, fewer than orchestration.min_night_rows "
            f"({least:,}); version {night.warm_start.version} keeps serving and the next night trains these days with "
            f"its own (set orchestration.min_night_rows = 0 to train every night)")  # fmt: skip
