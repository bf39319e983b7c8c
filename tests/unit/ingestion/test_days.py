import pytest

from ingestion.config import DataConfig
from ingestion.days import DayError, day_value, parse_day
from training.codec import decode


def test_dates_count_days_since_1970_so_consecutive_dates_are_consecutive_days() -> None:
    assert parse_day("1970-01-01") == 0
    assert parse_day("2026-11-25") - parse_day("2026-11-24") == 1
    assert parse_day("2026-03-01") - parse_day("2026-02-28") == 1
    assert day_value(parse_day("2026-11-24"), dated=True) == "2026-11-24"
    assert parse_day("7") == parse_day(7) == day_value(7, dated=False) == 7


@pytest.mark.parametrize("value", ["yesterday", "2026-13-01", -1, True])
def test_what_is_not_a_day_is_refused(value) -> None:
    with pytest.raises(DayError):
        parse_day(value)


def test_a_config_of_dates_keeps_its_format_through_replace() -> None:
    import dataclasses

    data = decode(DataConfig, {"source": "parquet", "path": "/w", "dense": ["a"], "sparse": ["b"],
                               "train_days": ["2026-11-20"], "eval_days": ["2026-11-21"]})  # fmt: skip
    assert data.dated and data.train_days == (parse_day("2026-11-20"),)
    assert dataclasses.replace(data, train_days=(parse_day("2026-11-19"),)).dated


@pytest.mark.parametrize(("changes", "message"), [
    ({"train_days": ("2026-11-20",), "eval_days": (3,)}, "mixes integers and dates"),
    ({"source": "synthetic", "train_days": ("2026-11-20",), "eval_days": ("2026-11-21",)}, "Criteo days are integers"),
    ({"sparse": ()}, "at least one id column"),
    ({"dense": ()}, "at least one numeric column"),
    ({"dense": ("price", "user id")}, "'user id' is not a plain column name"),
    ({"dense": ("label",)}, "names the pipeline uses itself"),
    ({"dense": ("b",)}, "named twice"),
    ({"path": ""}, "needs the dataset's folder"),
])  # fmt: skip
def test_a_parquet_source_config_is_checked(changes, message) -> None:
    settings = {"source": "parquet", "path": "/w", "label": "clicked", "dense": ("a",), "sparse": ("b",),
                "train_days": (0,), "eval_days": (1,)}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        decode(DataConfig, {**settings, **changes})
