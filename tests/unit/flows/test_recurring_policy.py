"""The recurring policy on a real MLflow registry (SQLite): what a night continues
(`orchestration.continue_from`) and when a champion that stays is stale."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.deployments.pipeline import _judge_staleness
from flows.run.config import load_config
from flows.run.reports import for_people, run_report
from flows.tracking import lineage
from flows.tracking.lineage import (
    TAG_AS_OF,
    TAG_CHECKPOINT,
    TAG_DAYS,
    StaleChampionError,
    champion_staleness,
    plan_night,
    skipped_summary,
)
from flows.tracking.registry import CHAMPION_ALIAS
from flows.tracking.runs import tracking_client
from training.codec import encode

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def refused_twice(tmp_path: Path) -> tuple[Path, MlflowClient]:
    """Champion version 1 (days 0–1), then nights as of 3 and 4 that were refused: version 2
    (lineage 0–2) and version 3 (lineage 0–3), each with its kept checkpoint."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking_client(uri)  # a new store from the migrated template
    client.create_registered_model("dlrm-ctr")
    for version, days, as_of in ((1, "0,1", "2"), (2, "0,1,2", "3"), (3, "0,1,2,3", "4")):
        client.create_model_version("dlrm-ctr", source=str(tmp_path / f"m{version}"))
        for key, value in ((TAG_DAYS, days), (TAG_AS_OF, as_of), (TAG_CHECKPOINT, str(tmp_path / f"c{version}")),
                           ("promotion.reason", f"calibration of version {version} is outside the band")):  # fmt: skip
            client.set_model_version_tag("dlrm-ctr", str(version), key, value)
    client.set_registered_model_alias("dlrm-ctr", CHAMPION_ALIAS, "1")
    return tmp_path, client


def _config(tmp_path: Path, *extra: str):
    return load_config(ROOT / "configs" / "tiny.toml", [
        f'run_dir="{tmp_path}"', f'tracking.tracking_uri="sqlite:///{tmp_path / "mlflow.db"}"',
        'tracking.registered_model="dlrm-ctr"', *extra,
    ])  # fmt: skip


def test_latest_continues_the_newest_version_one_day_a_night_after_refusals_mocked_checkpoint(
    refused_twice, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path, client = refused_twice
    monkeypatch.setattr(lineage, "_warm_start", lambda config, version, lineage: str(version.version))
    from_champion = plan_night(_config(tmp_path), 5, client)
    assert from_champion.train_days == (2, 3, 4) and from_champion.warm_start == "1", "catching up from the champion"
    latest = plan_night(_config(tmp_path, 'orchestration.continue_from="latest"'), 5, client)
    assert latest.train_days == (4,) and latest.warm_start == "3", "one new day, from the newest version"
    assert "the newest trained version 3" in latest.note


def test_nights_without_a_promotion_are_tagged_and_make_the_champion_stale(refused_twice) -> None:
    tmp_path, client = refused_twice
    fresh = champion_staleness(_config(tmp_path, "orchestration.stale_after_nights=3"), client)
    assert (fresh.nights_without_promotion, fresh.stale, fresh.message) == (2, False, "")
    tags = client.get_registered_model("dlrm-ctr").tags
    assert tags["champion.nights_without_promotion"] == "2" and tags["champion.version"] == "1"
    assert tags["champion.as_of"] == "2"
    stale = champion_staleness(_config(tmp_path, "orchestration.stale_after_nights=2"), client)
    assert stale.stale and "\n" not in stale.message
    assert "has stood for 2 nights without a promotion" in stale.message and "version 3: calibration" in stale.message


def test_a_stale_champion_fails_the_night_when_so_configured(refused_twice) -> None:
    tmp_path, _ = refused_twice
    with pytest.raises(StaleChampionError, match="stale_after_nights = 2"):
        _judge_staleness(_config(tmp_path, "orchestration.stale_after_nights=2", 'orchestration.on_stale="fail"'))
    _judge_staleness(_config(tmp_path, "orchestration.stale_after_nights=3", 'orchestration.on_stale="fail"'))


def test_a_night_already_covered_reports_a_skipped_night_that_reads_back(refused_twice) -> None:
    """The champion (version 1) has trained on every day before 2: the night as of 2 trains
    nothing; its summary, built from the registry, survives the JSON the command reads."""
    tmp_path, client = refused_twice
    config = _config(tmp_path)
    night = plan_night(config, 2, client)
    assert night.skipped and night.earlier_version == "1"
    summary = skipped_summary(night, client, config)
    assert summary.champion_version == "1" and summary.model_version == "1" and summary.lineage_days == [0, 1]
    assert run_report(json.loads(json.dumps(encode(summary)))) == summary
    assert "as of day 2: skipped: champion version 1 has trained on every day" in for_people(summary)
