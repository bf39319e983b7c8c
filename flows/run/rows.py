"""The rows a run trains on, and the held-out rows that choose its length and fit its
calibrator.

The split is the tuner's holdout rule (ingestion/holdout.py): a hash of each row's own values
puts `evaluation.calibration_percent` % of each training day's rows aside, the same rows on
every machine; the evaluation days are never among them. A warm-started night refits the
calibrator on the held-out rows of the newest days its model has seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow.parquet as pq

from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from ingestion.holdout import HoldoutSplit, split_holdout
from ingestion.preprocess import features_dir
from training.locking import exclusive

# A run holds out its newest day whole only when that is at most a quarter of its days:
# on two days it would train on half of them.
PROGRESSIVE_MIN_DAYS = 4


@dataclass(frozen=True)
class TrainingRows:
    """What a run trains on, and the held-out rows its calibrator is fitted on (none when
    `evaluation.calibration = "none"`)."""

    train_files: tuple[str, ...]
    calibration_files: tuple[str, ...] = ()
    calibration_rows: int = 0
    calibration_days: tuple[int, ...] = ()
    # every training day's whole files, for a fresh run that chooses its length: where its
    # held-out rows fit no calibrator worth serving, the kept model trains on them too, so
    # the served model has trained on all of these (training/worker.py); a wide model kept
    # at its start is the regression fitted on them. Empty: held-out rows that never train
    # (a continuing night)
    refit_files: tuple[str, ...] = ()
    # the rows that choose a fresh run's length (`training.epochs = "auto"`): the held-out
    # rows of every training day, of which the calibrator's are the newest days'. Empty:
    # the calibrator's rows choose it (a continuing night, or the newest day held out whole)
    validation_files: tuple[str, ...] = ()

    def model_files(self, refit: bool) -> tuple[str, ...]:
        """The files the served model trained on: every training day after a refit."""
        return self.refit_files if refit and self.refit_files else self.train_files


def joined(parts: Sequence[HoldoutSplit]) -> HoldoutSplit:
    """Several days' splits as one."""
    return HoldoutSplit(tuple(f for p in parts for f in p.fit_files), tuple(f for p in parts for f in p.validation_files),
                        sum(p.fit_rows for p in parts), sum(p.validation_rows for p in parts))  # fmt: skip


def split_days(config: PipelineConfig, state_id: str, day_files: dict[int, Sequence[str]],
               percent: float, fold: int = 0) -> dict[int, HoldoutSplit]:  # fmt: skip
    """`percent` % of each day's rows held out by the holdout rule (fold `fold`'s slice).
    Each day is split once and reused (by the tuner, the run, and later nights'
    calibrators): a row's side depends on the row alone, so the days' splits together are
    the split of their union."""
    root = config.path(config.preprocess.features_dir) / state_id / (f"holdout-{percent:g}pct"
                                                                      + (f"-fold{fold}" if fold else ""))  # fmt: skip
    with exclusive(config.optuna_storage, f"{config.name}.holdout"):
        return {day: split_holdout(list(files), root / f"day={config.data.day_label(day)}", percent,
                                   config.preprocess.row_group_size, config.preprocess.duckdb_threads, fold)
                for day, files in sorted(day_files.items())}  # fmt: skip


def holdout_of(config: PipelineConfig, state_id: str, day_files: dict[int, Sequence[str]], percent: float,
               fold: int = 0) -> HoldoutSplit:  # fmt: skip
    """The days' splits (`split_days`) taken together."""
    return joined(list(split_days(config, state_id, day_files, percent, fold).values()))


def holds_out_rows(config: PipelineConfig) -> bool:
    """Whether a run puts `evaluation.calibration_percent` % of its training rows aside: when
    it calibrates or chooses its length (`training_rows`)."""
    return config.evaluation.calibration != "none" or config.training.chooses_epochs


def training_rows(config: PipelineConfig, features: Features, lineage_days: Sequence[int] = (),
                  continues: bool = False) -> TrainingRows:  # fmt: skip
    """The run's training days, less the held-out rows when it calibrates or chooses its length
    (`training.epochs = "auto"`: the same rows choose it, training/loop/validation.py); a
    fresh run on several days that chooses its length may hold out the newest day instead
    (`progressive_rows`; `continues`: the run continues a model). Otherwise the calibrator
    is fitted on the held-out rows of the newest `evaluation.calibration_days` days the model
    has seen: this run's training days and, for a night continuing a champion, the earlier
    days of its lineage whose features are still there (no model of the lineage trained on
    their held-out rows, as long as its runs held out the same share: each trains on the fit
    side only). A fresh run that chooses its length is scored on every training day's
    held-out rows (`validation_files`), the calibrator's among them."""
    data, evaluation = config.data, config.evaluation
    if not holds_out_rows(config) or not data.train_days:
        return TrainingRows(features.train_files(data.train_days))
    fresh_and_choosing = config.training.chooses_epochs and not continues
    newest_day = config.training.validation_rows == "newest_day"
    if fresh_and_choosing and newest_day and len(data.train_days) >= PROGRESSIVE_MIN_DAYS:
        return progressive_rows(config, features)
    day_files = {day: features.files[day] for day in data.train_days}
    # A lineage that chooses its length was refit on whole days (`progressive_rows`): only
    # this night's own held-out rows are unseen by the model it continues.
    for day in () if config.training.chooses_epochs else lineage_days:
        if day not in day_files and (files := _feature_files(config, features, day)):
            day_files[day] = files
    window = sorted(day_files)[-evaluation.calibration_days :]
    splits = split_days(config, features.state.state_id,
                        {day: files for day, files in day_files.items() if day in data.train_days or day in window},
                        evaluation.calibration_percent)  # fmt: skip
    trained = joined([splits[day] for day in data.train_days])
    held_out = joined([splits[day] for day in window])
    # A fresh run that chooses its length scores every day's held-out rows, not only the
    # calibrator's newest days: on MovieLens-100K (20 weekly days, 7 in the calibrator's
    # window) 6,580 rows instead of 1,648, and five seeds' NE 0.96 % apart instead of 2.0 %
    # at the same mean (docs/run-length.md); where it keeps no calibrator, the kept model then
    # trains on all of them, so no held-out row is left out of the served model.
    return TrainingRows(trained.fit_files, held_out.validation_files, held_out.validation_rows, tuple(window),
                        refit_files=features.train_files(data.train_days) if fresh_and_choosing else (),
                        validation_files=trained.validation_files if fresh_and_choosing else ())  # fmt: skip


def progressive_rows(config: PipelineConfig, features: Features) -> TrainingRows:
    """A fresh run on `PROGRESSIVE_MIN_DAYS` or more dated days that chooses its length
    (`training.epochs = "auto"`, `training.validation_rows = "newest_day"`): it trains on
    the earlier days and is scored on the newest,
    as the next day will score it (users and items drift; a hash slice of the same days
    shares theirs). The newest day chooses the length and fits the calibrator, on
    predictions of a model that never saw it; where no calibrator is kept, the kept model
    then trains a pass over it (and the references train on `refit_files`, every day)."""
    days = sorted(config.data.train_days)
    newest = tuple(features.files[days[-1]])
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in newest)
    return TrainingRows(features.train_files(tuple(days[:-1])), newest, rows, (days[-1],),
                        refit_files=features.train_files(tuple(days)))  # fmt: skip


def _feature_files(config: PipelineConfig, features: Features, day: int) -> tuple[str, ...]:
    """An earlier day's feature files in this state, or none if they are gone."""
    folder = features_dir(config.path(config.preprocess.features_dir), features.state, day)
    return tuple(str(path) for path in sorted(folder.glob("*.parquet"))) if (folder / "_done.json").is_file() else ()
