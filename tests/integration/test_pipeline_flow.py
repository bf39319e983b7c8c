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


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


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
    for key in ("eval_ne", "eval_auc", "eval_calibration", "eval_log_loss", "bayes_ne", "baseline_constant_ne"):
        assert key in metrics
    assert metrics["eval_ne"] == pytest.approx(summary["eval_ne"])
    assert metrics["bayes_ne"] < metrics["eval_ne"] < 0.95 < metrics["baseline_constant_ne"] + 0.01
    assert run.data.params["training.nproc"] == "2"
    assert run.data.params["model.bottom_mlp"] == "[32, 8]"
    history = client.get_metric_history(run.info.run_id, "train_window_ne")
    assert len(history) >= 5 and history[-1].step > history[0].step
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "training")}
    assert {"training/plan.txt", "training/plan.json"} <= artifacts
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/ne_curve.png", "plots/reliability.png"} <= plots
    assert run.info.artifact_uri.startswith(str(config.path("mlartifacts"))), "artifacts stay in the run folder"


def test_model_is_registered_and_loads(pipeline_run) -> None:
    config, summary = pipeline_run
    client = MlflowClient(tracking_uri=config.tracking_uri)
    versions = client.search_model_versions(f"name='{config.tracking.registered_model}'")
    assert summary["model_version"] in {str(v.version) for v in versions}
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
