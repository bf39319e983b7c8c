"""The calibration stage: the training rows split into what the model trains on and what its
calibrator is fitted on, and the calibrator fitted on the trained model's predictions there.

The split is the tuner's holdout rule (ingestion/holdout.py): a hash of each row's own values
puts `evaluation.calibration_percent` % of each training day's rows aside, the same rows on
every machine; the evaluation days are never among them. A warm-started night refits the
calibrator on the held-out rows of the newest days its model has seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from prefect import get_run_logger, task

from evaluation.calibration import CalibrationError, Calibrator, fit_calibrator, out_of_fold_gain
from evaluation.report import Scores
from flows.config import PipelineConfig
from flows.feature_files import Features
from flows.features import STAGE
from ingestion.holdout import HoldoutSplit, split_holdout
from ingestion.preprocess import features_dir
from training.job import CALIBRATION_PART, JobFolder
from training.locking import exclusive


@dataclass(frozen=True)
class TrainingRows:
    """What a run trains on, and the held-out rows its calibrator is fitted on (none when
    `evaluation.calibration = "none"`)."""

    train_files: tuple[str, ...]
    calibration_files: tuple[str, ...] = ()
    calibration_rows: int = 0
    calibration_days: tuple[int, ...] = ()


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


def training_rows(config: PipelineConfig, features: Features, lineage_days: Sequence[int] = ()) -> TrainingRows:
    """The run's training days, less the calibration rows when it calibrates. The calibrator
    is fitted on the held-out rows of the newest `evaluation.calibration_days` days the model
    has seen: this run's training days and, for a night continuing a champion, the earlier
    days of its lineage whose features are still there (no model of the lineage trained on
    their held-out rows, as long as its runs held out the same share: each trains on the fit
    side only)."""
    data, evaluation = config.data, config.evaluation
    if evaluation.calibration == "none" or not data.train_days:
        return TrainingRows(features.train_files(data.train_days))
    day_files = {day: features.files[day] for day in data.train_days}
    for day in lineage_days:
        if day not in day_files and (files := _feature_files(config, features, day)):
            day_files[day] = files
    window = sorted(day_files)[-evaluation.calibration_days :]
    splits = split_days(config, features.state.state_id,
                        {day: files for day, files in day_files.items() if day in data.train_days or day in window},
                        evaluation.calibration_percent)  # fmt: skip
    trained = joined([splits[day] for day in data.train_days])
    held_out = joined([splits[day] for day in window])
    return TrainingRows(trained.fit_files, held_out.validation_files, held_out.validation_rows, tuple(window))


def _feature_files(config: PipelineConfig, features: Features, day: int) -> tuple[str, ...]:
    """An earlier day's feature files in this state, or none if they are gone."""
    folder = features_dir(config.path(config.preprocess.features_dir), features.state, day)
    return tuple(str(path) for path in sorted(folder.glob("*.parquet"))) if (folder / "_done.json").is_file() else ()


@task(name="calibrate", **STAGE)
def calibrate_task(config: PipelineConfig, folder: JobFolder) -> Calibrator:
    """The pipeline's calibration stage (`fit_served_calibrator`)."""
    log = get_run_logger()
    return fit_served_calibrator(config.evaluation.calibration, folder, lambda line: log.info("calibration: %s", line))


def fit_served_calibrator(method: str, folder: JobFolder, say: Callable[[str], None]) -> Calibrator:
    """The calibrator of the trained model in `folder`, fitted on its predictions of the
    held-out training rows and written beside them; the identity when calibration is off or
    those rows cannot fit one. The pipeline and `dlrm train` (node 0) both fit it here."""
    if method == "none":
        calibrator = Calibrator()
    else:
        calibrator = _fitted(method, folder.read_predictions(CALIBRATION_PART), say)
    folder.write_calibrator(calibrator)
    return calibrator


def _fitted(method: str, held_out: Scores, say: Callable[[str], None]) -> Calibrator:
    rows = len(held_out.labels)
    try:
        calibrator = fit_calibrator(method, held_out.labels, held_out.predictions)
    except CalibrationError as error:
        say(f"not fitted ({error}); the model's own probabilities are served")
        return Calibrator(rows=rows, note=str(error))
    # On few rows a calibrator can fit their noise: it is kept only if it also lowers the
    # log loss of rows it was not fitted on (5 folds of the held-out rows).
    gain = out_of_fold_gain(method, held_out.labels, held_out.predictions)
    if gain <= 0.0:
        note = (f"{calibrator.describe()} did not lower the log loss of held-out rows it was not fitted on "
                f"({gain:+.2e} a row over 5 folds): the model's own probabilities are served")  # fmt: skip
        say(note)
        return Calibrator(rows=rows, note=note)
    before = float(held_out.predictions.sum() / max(held_out.labels.sum(), 1.0))
    after = float(np.sum(calibrator.apply(held_out.predictions)) / max(held_out.labels.sum(), 1.0))
    say(f"{calibrator.describe()}; on those rows Σ predictions / Σ clicks {before:.3f} → {after:.3f}")
    return calibrator
