"""`dlrm serve`'s deployments, and prefect.yaml offering the same ones to work pools."""

import importlib
from pathlib import Path

import pytest
import yaml

from flows.deployments.serve import build_deployments
from flows.run.config import ConfigError, load_config
from flows.tuning.hyperparameters import RETUNE_DEPLOYMENT

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "configs" / "demo.toml")


def test_serve_builds_nightly_retrain_and_retune() -> None:
    deployments = {f"{d.flow_name}/{d.name}": d for d in build_deployments(DEMO, ["training.batch_size=4096"])}
    assert set(deployments) == {"pipeline/nightly", "retrain/retrain", RETUNE_DEPLOYMENT, "characterize/characterize"}
    nightly = deployments["pipeline/nightly"]
    assert [s.schedule.cron for s in nightly.schedules] == [load_config(DEMO).orchestration.nightly_cron]
    assert not deployments["retrain/retrain"].schedules, "retrain runs on demand only"
    for deployment in deployments.values():
        expected = {"config_path": DEMO, "overrides": ["training.batch_size=4096"]}
        if deployment is nightly:  # each night continues the champion as of the newest complete day
            expected["as_of"] = "newest"
        assert deployment.parameters == expected
    from prefect.utilities.callables import parameter_schema

    from flows.deployments.pipeline import retrain

    fields = parameter_schema(retrain).properties
    assert {"batch_size", "train_days", "eval_days", "config_path"} <= set(fields), "typed fields for the Run form"
    assert fields["batch_size"]["anyOf"][0]["type"] == "integer"


def test_cron_comes_from_the_config_and_is_checked() -> None:
    (nightly, *_) = build_deployments(DEMO, ['orchestration.nightly_cron="30 4 * * 1-5"'])
    assert nightly.schedules[0].schedule.cron == "30 4 * * 1-5"
    with pytest.raises(ConfigError, match="orchestration.nightly_cron"):
        build_deployments(DEMO, ['orchestration.nightly_cron="every night"'])


def test_prefect_yaml_offers_the_same_deployments() -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    served = {f"{d.flow_name}/{d.name}": d for d in build_deployments(DEMO)}
    listed = {}
    for entry in spec["deployments"]:
        module, _, attribute = entry["entrypoint"].partition(":")
        flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), attribute)
        listed[f"{flow.name}/{entry['name']}"] = entry
    assert set(listed) == set(served)
    assert [s["cron"] for s in listed["pipeline/nightly"]["schedules"]] == [load_config(DEMO).orchestration.nightly_cron]
    assert listed["pipeline/nightly"]["parameters"]["as_of"] == served["pipeline/nightly"].parameters["as_of"]
    import prefect

    assert spec["prefect-version"] == prefect.__version__, "the same Prefect as the client"


@pytest.mark.parametrize(("told", "expected"), [(None, 2.0), ("7", None)])
def test_a_trainer_node_asks_for_its_runs_every_2_s_unless_prefect_is_told_otherwise_with_serve_mocked(
    monkeypatch: pytest.MonkeyPatch, told: str | None, expected: float | None
) -> None:
    """Prefect's `serve` (which would run until stopped) stands in recorded here: a trainer
    node polls as often as the stage that started its run; PREFECT_RUNNER_POLL_FREQUENCY,
    when set, is Prefect's to apply (no `query_seconds` passed); the pipeline's deployments
    keep Prefect's default."""
    import flows.deployments.serve as serving

    calls: list[dict] = []
    monkeypatch.setattr(serving, "serve", lambda *deployments, **options: calls.append(options))
    monkeypatch.setattr(serving, "cancel_runs_left_running", lambda deployments: 0)
    if told is None:
        monkeypatch.delenv("PREFECT_RUNNER_POLL_FREQUENCY", raising=False)
    else:
        monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", told)
    config = load_config(DEMO)
    serving.serve_deployments(config, DEMO, trainer_node=1)
    serving.serve_deployments(config, DEMO)
    assert calls[0].get("query_seconds") == expected
    assert "query_seconds" not in calls[1]
