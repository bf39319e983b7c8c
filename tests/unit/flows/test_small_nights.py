"""A night with too few new rows waits (`orchestration.min_night_rows`): fewer rows than give
`training.min_steps` steps at the smallest batch train a night by chance, so the champion keeps
serving and the next night trains these days with its own."""

from pathlib import Path

import pytest

from flows.run.config import ConfigError, load_config
from flows.run.nights import Night, WarmStart, night_min_rows, waits_for_rows
from ingestion.preprocess import PreprocessState
from training.config import ModelConfig

ROOT = Path(__file__).resolve().parents[3]
STATE = PreprocessState("s", {"C1": 10}, (0, 1), 12_000, 0.25)
WARM = WarmStart("4", "run", "/checkpoint", (0, 1), ModelConfig(), STATE)


def _config(tmp_path: Path, *overrides: str):
    return load_config(ROOT / "configs" / "tiny.toml", [f'run_dir="{tmp_path}"', *overrides])


def test_auto_is_min_steps_at_32_rows_a_process_after_the_held_out_rows(tmp_path: Path) -> None:
    # tiny: min_steps 20, 2 processes, 10 % held out: 20 × 64 / 0.9 = 1,422.2
    assert night_min_rows(_config(tmp_path)) == 1_423
    assert night_min_rows(_config(tmp_path, "training.min_steps=50", "training.nproc=1")) == 1_778
    assert night_min_rows(_config(tmp_path, 'evaluation.calibration="none"')) == 1_280, "no rows held out"
    assert night_min_rows(_config(tmp_path, "training.min_steps=0")) == 0
    assert night_min_rows(_config(tmp_path, "orchestration.min_night_rows=5000")) == 5_000


def test_a_night_continuing_the_champion_waits_below_the_bound_and_says_why_and_what_to_set(tmp_path: Path) -> None:
    config = _config(tmp_path, "orchestration.min_night_rows=5000")
    night = Night(4, (2, 3), WARM)
    reason = waits_for_rows(config, night, 4_999)
    assert reason.startswith("waiting for more rows: days [2, 3] hold 4,999 new rows")
    assert "(5,000)" in reason and "version 4 keeps serving" in reason and "min_night_rows = 0" in reason
    assert waits_for_rows(config, night, 5_000) == "", "enough rows: the night trains"
    assert waits_for_rows(config, Night(4, (0, 1, 2, 3)), 10) == "", "a first model never waits"
    assert waits_for_rows(_config(tmp_path, "orchestration.min_night_rows=0"), night, 1) == ""


@pytest.mark.parametrize("value", ["-1", '"never"', "true"])
def test_a_bad_bound_is_one_clear_line(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="min_night_rows"):
        _config(tmp_path, f"orchestration.min_night_rows={value}")
