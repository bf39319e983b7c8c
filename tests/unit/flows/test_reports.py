"""The commands' typed reports: checked when built, read back from their JSON, and a report
that cannot be read is one line naming the field."""

import dataclasses
import inspect
from pathlib import Path

import pytest

from flows.cli import _is_user_facing, commands
from flows.run import reports
from flows.run.reports import RunSummary, SkippedNight, run_report
from training.codec import Checked, SchemaError, encode


def _skipped(**changes) -> SkippedNight:
    values = {"as_of": 5, "skip_reason": "nothing new to train", "lineage_days": [0, 1, 2, 3, 4], "eval_ne": 0.8,
              "model_version": "4", "promotion_reason": "nothing trained", "champion_version": "4"}  # fmt: skip
    return SkippedNight(**{**values, **changes})


def test_every_report_checks_its_fields_when_built() -> None:
    classes = [c for _, c in inspect.getmembers(reports, inspect.isclass)
               if dataclasses.is_dataclass(c) and c.__module__ == reports.__name__]  # fmt: skip
    assert len(classes) >= 12 and all(issubclass(c, Checked) for c in classes), classes


@pytest.mark.parametrize("field, value, needle", [
    ("champion_version", 4, "SkippedNight.champion_version: expected str | NoneType, got int 4"),
    ("lineage_days", [0, 1.5], "SkippedNight.lineage_days: [1]: expected int | str, got float 1.5"),
    ("eval_ne", "0.8", "SkippedNight.eval_ne: expected float | NoneType, got str '0.8'"),
    ("skipped", 1, "SkippedNight.skipped: expected bool, got int 1"),
])  # fmt: skip
def test_a_field_of_the_wrong_type_fails_where_the_report_is_built(field: str, value, needle: str) -> None:
    with pytest.raises(SchemaError) as caught:
        _skipped(**{field: value})
    assert str(caught.value) == needle


def test_reports_read_back_from_their_json_form() -> None:
    skipped = _skipped(eval_ne=None, as_of="2026-11-02", lineage_days=["2026-11-01"])
    assert run_report(encode(skipped)) == skipped
    summary = RunSummary(as_of=None, eval_days=[2], days_trained=[0, 1], lineage_days=[0, 1], warm_start_version=None,
                         rows_ingested=10, rows_quarantined=0, files_failed=[], days_already_ingested=[],
                         metrics={"eval_ne": 0.8, "eval_ne_day_2": 0.79}, model_version="3")  # fmt: skip
    assert run_report(encode(summary)) == summary
    spread = dataclasses.replace(summary, seed_spread=0.0041, seed_spread_seeds=3)
    assert run_report(encode(spread)) == spread and summary.seed_spread is None
    with pytest.raises(SchemaError):
        dataclasses.replace(summary, metrics={"eval_ne": "high"})


def test_a_report_that_cannot_be_read_is_one_line_for_the_user() -> None:
    data = {**encode(_skipped()), "champion_version": 4}
    with pytest.raises(SchemaError) as caught:
        run_report(data)
    line = str(caught.value)
    assert line == "the pipeline's summary: champion_version: expected str, got int 4" and "\n" not in line
    assert _is_user_facing(caught.value) and "SchemaError" in commands.USER_FACING_ERRORS


def test_the_report_shows_the_seed_spread_only_where_it_was_measured(tmp_path: Path) -> None:
    from flows.run.config import load_config
    from flows.run.reports import for_people

    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "tiny.toml", [f'run_dir="{tmp_path}"'])
    metrics = {"eval_ne": 0.8, "eval_count": 100.0, "eval_auc": 0.7, "eval_calibration": 1.0, "eval_log_loss": 0.5}
    summary = RunSummary(as_of=None, eval_days=[2], days_trained=[0, 1], lineage_days=[0, 1], warm_start_version=None,
                         rows_ingested=10, rows_quarantined=0, files_failed=[], days_already_ingested=[], metrics=metrics,
                         tuning_decision="use_tuned", tuning_reason="key k was tuned")  # fmt: skip
    assert "seed spread" not in for_people(summary, config)
    shown = for_people(dataclasses.replace(summary, seed_spread=0.0041, seed_spread_seeds=3), config)
    assert "  seed spread          0.41 % of validation NE over 3 seeds of the trial these parameters come from" in shown
