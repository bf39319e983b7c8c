"""The calibration rows: each training day split once by the holdout rule, the run training on
the fit side only, and the calibrator's rows taken from the newest days the model has seen."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq

from flows.run.config import load_config
from flows.run.feature_files import Features
from flows.run.rows import training_rows
from ingestion.holdout import split_holdout

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"


def _rows(files) -> set[tuple]:
    table = pq.read_table(list(files), partitioning=None)
    return set(zip(*(table[name].to_pylist() for name in table.column_names)))


def _copied(tiny_features, tmp_path: Path) -> tuple[Path, Features]:
    """The shared tiny features, copied: the splits are written beside them."""
    state, files = tiny_features
    shared = Path(files[0][0]).parents[2]
    root = Path(shutil.copytree(shared, tmp_path / "features"))
    moved = {day: [str(root / Path(f).relative_to(shared)) for f in day_files] for day, day_files in files.items()}
    return root, Features(state, moved, [])


def _config(root: Path, *extra: str):
    return load_config(TINY, [f'run_dir="{root.parent}"', f'preprocess.features_dir="{root.name}"',
                              "data.train_days=[2]", "data.eval_days=[0]", *extra])  # fmt: skip


def test_a_night_trains_on_its_fit_rows_and_calibrates_on_its_newest_lineage_days(tiny_features, tmp_path: Path) -> None:
    root, features = _copied(tiny_features, tmp_path)
    files = features.files
    rows = training_rows(_config(root, "evaluation.calibration_days=2"), features, lineage_days=(1, 2))
    assert rows.calibration_days == (1, 2), "the newest two days the model has seen"
    trained, held_out = _rows(rows.train_files), _rows(rows.calibration_files)
    day_2, days_1_2 = _rows(files[2]), _rows(files[1]) | _rows(files[2])
    assert trained <= day_2 and not trained & held_out, "the run trains on day 2's fit side only"
    assert held_out <= days_1_2 and held_out & _rows(files[1]) and held_out & day_2
    assert 0.07 < rows.calibration_rows / 12_000 < 0.13 and rows.calibration_rows == sum(
        pq.read_metadata(f).num_rows for f in rows.calibration_files)
    # the days split one by one are the split of their union (a row's side is its own)
    union = split_holdout([*files[1], *files[2]], tmp_path / "union", 10.0)
    assert _rows(union.validation_files) == held_out
    only_newest = training_rows(_config(root, "evaluation.calibration_days=1"), features, lineage_days=(1, 2))
    assert only_newest.calibration_days == (2,) and _rows(only_newest.calibration_files) == held_out & day_2
    assert only_newest.train_files == rows.train_files


def test_without_calibration_the_run_trains_on_every_row(tiny_features, tmp_path: Path) -> None:
    root, features = _copied(tiny_features, tmp_path)
    rows = training_rows(_config(root, 'evaluation.calibration="none"'), features, lineage_days=(1, 2))
    assert rows.train_files == tuple(features.files[2]) and rows.calibration_files == () and rows.calibration_rows == 0


def test_a_fresh_run_choosing_its_length_is_scored_on_every_days_held_out_rows(tiny_features, tmp_path: Path) -> None:
    """The calibrator's rows are the newest days'; the rows that choose the run's length are
    every training day's held-out rows (more rows, a steadier choice), and they are what the
    kept model trains on last where no calibrator is kept (training/worker.py)."""
    from flows.run.job import build_job

    root, features = _copied(tiny_features, tmp_path)
    files = features.files
    config = load_config(TINY, [f'run_dir="{root.parent}"', f'preprocess.features_dir="{root.name}"',
                                "data.train_days=[1, 2]", "data.eval_days=[0]", 'training.epochs="auto"',
                                "evaluation.calibration_days=1"])  # fmt: skip
    rows = training_rows(config, features)
    trained, calibration, validation = _rows(rows.train_files), _rows(rows.calibration_files), _rows(rows.validation_files)
    assert rows.calibration_days == (2,) and calibration <= _rows(files[2])
    assert calibration < validation, "the calibrator's rows are among the validation rows"
    assert validation & _rows(files[1]) and validation & _rows(files[2]), "every training day's held-out rows"
    assert not trained & validation and trained | validation == _rows(files[1]) | _rows(files[2]), "no row left out"
    job = build_job(config, features, rows=rows)
    assert job.validation_files == rows.validation_files and job.calibration_files == rows.calibration_files
    # a night continuing a model is scored on the calibrator's rows, as before
    night = training_rows(config, features, lineage_days=(1, 2), continues=True)
    assert night.validation_files == ()
    assert build_job(config, features, rows=night).validation_files == night.calibration_files
