"""The validation slice of the training days: disjoint, complete, deterministic."""

import pyarrow as pa
import pyarrow.parquet as pq

from ingestion.holdout import split_holdout


def _rows(files) -> list[tuple]:
    table = pa.concat_tables([pq.read_table(f) for f in files]) if files else None
    return sorted(zip(*(table[c].to_pylist() for c in table.column_names), strict=True)) if table else []


def test_the_split_is_disjoint_complete_and_about_the_asked_size(tiny_features, tmp_path) -> None:
    _, files = tiny_features
    train = files[0] + files[1]
    split = split_holdout(train, tmp_path / "split", percent=10)
    fit, validation = _rows(split.fit_files), _rows(split.validation_files)
    assert sorted(fit + validation) == _rows(train), "every training row on exactly one side"
    assert split.fit_rows == len(fit) and split.validation_rows == len(validation)
    assert 0.07 < len(validation) / len(_rows(train)) < 0.13


def test_the_same_rows_land_on_the_same_side_whatever_the_file_order(tiny_features, tmp_path) -> None:
    _, files = tiny_features
    train = files[0] + files[1]
    one = split_holdout(train, tmp_path / "one", percent=10)
    two = split_holdout(list(reversed(train)), tmp_path / "two", percent=10)
    assert _rows(one.validation_files) == _rows(two.validation_files)
    again = split_holdout(train, tmp_path / "one", percent=10)  # reused, not redone
    assert again == one


def test_folds_hold_disjoint_validation_slices_and_each_fit_is_the_rest(tiny_features, tmp_path) -> None:
    import pytest

    _, files = tiny_features
    train = files[0] + files[1]
    folds = [split_holdout(train, tmp_path / f"fold-{f}", percent=10, fold=f) for f in range(3)]
    validations = [set(_rows(split.validation_files)) for split in folds]
    assert all(not (a & b) for i, a in enumerate(validations) for b in validations[i + 1 :]), "disjoint slices"
    for split, validation in zip(folds, validations, strict=True):
        assert sorted(_rows(split.fit_files) + sorted(validation)) == _rows(train)
        assert 0.07 < len(validation) / len(_rows(train)) < 0.13
    # fold 0 is the slice tuning and calibration use by default
    assert validations[0] == set(_rows(split_holdout(train, tmp_path / "default", percent=10).validation_files))
    with pytest.raises(ValueError, match="do not fit"):
        split_holdout(train, tmp_path / "too-many", percent=40, fold=2)
