"""A night whose champion has fallen too far behind stops in one line, on a real MLflow
registry (SQLite): refused nights add unseen days, and `orchestration.max_catch_up_days`
bounds how many one night retrains."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from flows.run.nights import CatchUpError
from flows.tracking import lineage
from flows.tracking.lineage import TAG_DAYS, plan_night
from flows.tracking.registry import CHAMPION_ALIAS
from flows.tracking.runs import tracking_client

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def champion_of_days_0_1(tmp_path: Path) -> tuple[Path, MlflowClient]:
    """A registry whose champion has trained days 0–1 (its lineage tag)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking_client(uri)  # a new store from the migrated template
    client.create_registered_model("dlrm-ctr")
    version = client.create_model_version("dlrm-ctr", source=str(tmp_path / "m1")).version
    client.set_model_version_tag("dlrm-ctr", version, TAG_DAYS, "0,1")
    client.set_registered_model_alias("dlrm-ctr", CHAMPION_ALIAS, version)
    return tmp_path, client


def _config(tmp_path: Path, bound: int):
    return load_config(ROOT / "configs" / "tiny.toml", [
        f'run_dir="{tmp_path}"', f'tracking.tracking_uri="sqlite:///{tmp_path / "mlflow.db"}"',
        'tracking.registered_model="dlrm-ctr"', f"orchestration.max_catch_up_days={bound}",
    ])  # fmt: skip


def test_more_unseen_days_than_the_bound_stop_the_night_in_one_line(champion_of_days_0_1) -> None:
    tmp_path, client = champion_of_days_0_1
    with pytest.raises(CatchUpError) as stopped:
        plan_night(_config(tmp_path, 2), 6, client)  # days 2–5 unseen
    message = str(stopped.value)
    assert "\n" not in message and "4 unseen days [2, 3, 4, 5]" in message
    assert "orchestration.max_catch_up_days = 2" in message and "--set orchestration.max_catch_up_days=0" in message


@pytest.mark.parametrize("bound", [0, 4])
def test_within_the_bound_or_without_one_the_night_continues_the_champion_mocked_checkpoint(
    champion_of_days_0_1, monkeypatch: pytest.MonkeyPatch, bound: int
) -> None:
    tmp_path, client = champion_of_days_0_1
    monkeypatch.setattr(lineage, "_warm_start", lambda config, champion, lineage: None)  # no checkpoint here
    night = plan_night(_config(tmp_path, bound), 6, client)
    assert night.train_days == (2, 3, 4, 5)
