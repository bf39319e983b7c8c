"""The `pipeline` flow end to end on the tiny config, under a real (temporary) Prefect server."""

from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from flows.config import load_config
from ingestion.warehouse import read_manifest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline_run(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    from flows.pipeline import run_pipeline

    run_dir = tmp_path_factory.mktemp("tiny-run")
    overrides = [f'run_dir="{run_dir}"']
    summary = run_pipeline(str(ROOT / "configs" / "tiny.toml"), overrides)
    return load_config(ROOT / "configs" / "tiny.toml", overrides), summary


def test_warehouse_and_features_hold_every_row(pipeline_run) -> None:
    config, summary = pipeline_run
    warehouse = config.path("warehouse")
    for day in (0, 1, 2):
        manifest = read_manifest(warehouse, day)
        assert manifest["rows_read"] == manifest["rows_written"] + manifest["rows_quarantined"] == 6000
        assert pq.read_table(warehouse / f"day={day}").num_rows == 6000
    assert summary["rows_ingested"] == 18_000 and summary["rows_quarantined"] == 0
    features = list(config.path("features").glob("*/day=2/*.parquet"))
    assert pq.read_table(features, partitioning=None).num_rows == 6000


def test_mlflow_run_has_metrics_params_plan_and_plots(pipeline_run) -> None:
    config, summary = pipeline_run
    client = MlflowClient(tracking_uri=config.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    metrics = run.data.metrics
    for key in ("eval_ne", "eval_auc", "eval_calibration", "eval_log_loss", "eval_ne_day_2", "bayes_ne",
                "baseline_constant_ne", "logistic_regression_ne", "ne_gain_vs_logistic_regression_pct",
                "eval_ne_slice_rank_1"):  # fmt: skip
        assert key in metrics, key
    assert metrics["eval_ne"] == pytest.approx(summary["eval_ne"]) == pytest.approx(metrics["eval_ne_day_2"])
    assert metrics["bayes_ne"] < metrics["eval_ne"] < 0.95 < metrics["baseline_constant_ne"] + 0.01
    assert run.data.params["training.nproc"] == "2"
    assert run.data.params["model.bottom_mlp"] == "[32, 8]"
    history = client.get_metric_history(run.info.run_id, "train_window_ne")
    assert len(history) >= 5 and history[-1].step > history[0].step
    heldout = client.get_metric_history(run.info.run_id, "heldout_ne")
    assert len(heldout) >= 2 and all(0 < m.value < 2 for m in heldout)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "training")}
    assert {"training/plan.txt", "training/plan.json"} <= artifacts
    documents = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/report.md", "evaluation/slices.json", "evaluation/per_day.json"} <= documents
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/ne_curve.png", "plots/reliability.png"} <= plots
    assert run.info.artifact_uri.startswith(str(config.path("mlartifacts"))), "artifacts stay in the run folder"


def test_model_is_registered_loads_and_becomes_champion(pipeline_run) -> None:
    config, summary = pipeline_run
    client = MlflowClient(tracking_uri=config.tracking_uri)
    versions = client.search_model_versions(f"name='{config.tracking.registered_model}'")
    assert summary["model_version"] in {str(v.version) for v in versions}
    assert summary["promoted"] and summary["promotion_reason"] == "no champion yet"
    champion = client.get_model_version_by_alias(config.tracking.registered_model, "champion")
    assert str(champion.version) == summary["model_version"]
    mlflow.set_tracking_uri(config.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{config.tracking.registered_model}/{summary['model_version']}")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_rerun_reuses_ingested_days(prefect_server, pipeline_run) -> None:
    from flows.pipeline import run_pipeline

    config, first = pipeline_run
    again = run_pipeline(str(ROOT / "configs" / "tiny.toml"), [f'run_dir="{config.run_dir}"'])
    assert again["rows_ingested"] == first["rows_ingested"]
    assert again["mlflow_run_id"] != first["mlflow_run_id"]
    assert int(again["model_version"]) == int(first["model_version"]) + 1
    # Same data, same seed: the same NE, which does not beat the champion scored on the same day.
    assert again["champion_ne_same_days"] == pytest.approx(first["eval_ne"], rel=1e-6)
    assert not again["promoted"]
    client = MlflowClient(tracking_uri=config.tracking_uri)
    champion = client.get_model_version_by_alias(config.tracking.registered_model, "champion")
    assert str(champion.version) == first["model_version"]
    plots = {a.path for a in client.list_artifacts(again["mlflow_run_id"], "plots")}
    assert "plots/ne_relative_to_champion.png" in plots


def test_prefect_artifacts_are_published(pipeline_run) -> None:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def latest(key: str):
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return found[-1] if found else None

    summary = asyncio.run(latest("pipeline-summary"))
    assert summary is not None and "logistic_regression" in summary.data and "| **all** |" in summary.data
    table = asyncio.run(latest("evaluation-by-day"))
    assert table is not None and table.type == "table"
