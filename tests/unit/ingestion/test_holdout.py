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
