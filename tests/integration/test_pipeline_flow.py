"""The `pipeline` flow end to end on the tiny config, under a real (temporary) Prefect server.
Its runs train on warm ranks (tests/integration/conftest.py), but for the killed worker's:
torchrun's report of a lost rank is what the train task retries on."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import mlflow
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from foreign_python import (
    champion_scores_elsewhere,
    make_foreign_python,
    raw_lines,
    run_predictions,
)
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from ingestion.warehouse import read_manifest
from training.job import JobFolder
from training.torch_range import matched_set

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline_run(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    """`dlrm run --json` on the tiny config, in this process (the session's Prefect server),
    counting how often the command reads its config file."""
    import contextlib
    import io

    import flows.run.config
    from flows.cli import main

    run_dir = tmp_path_factory.mktemp("tiny-run")
    overrides = [f'run_dir="{run_dir}"']
    reads, read_toml = [], flows.run.config.read_toml

    def counted(path: Path):
        reads.append(path)
        return read_toml(path)

    output = io.StringIO()
    flows.run.config.read_toml = counted
    try:
        CALLED["at_ms"] = time.time() * 1000
        with contextlib.redirect_stdout(output):
            assert main(["run", "--config", str(ROOT / "configs" / "tiny.toml"), "--set", overrides[0], "--json"]) == 0
        CALLED["returned_ms"] = time.time() * 1000
    finally:
        flows.run.config.read_toml = read_toml
    CALLED["config_reads"] = len(reads)
    return load_config(ROOT / "configs" / "tiny.toml", overrides), json.loads(output.getvalue().strip().splitlines()[-1])


CALLED: dict[str, float] = {}  # when the module's pipeline run was called and returned; its config reads


def test_the_command_reads_its_config_once(pipeline_run) -> None:
    assert CALLED["config_reads"] == 1, "parsed once, then one resolved config travels through the run"


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


def test_the_summary_reports_the_training_job_as_dlrm_train_does(pipeline_run) -> None:
    config, summary = pipeline_run
    assert summary["world_size"] == 2 and summary["global_batch_size"] == config.training.batch_size == 256
    trained, held_out = summary["rows_trained"], summary["calibration_rows"]
    assert trained + held_out == 12_000 and 0.07 < held_out / 12_000 < 0.13, "10 % held out for the calibrator"
    assert summary["steps"] == -(-trained // 256), "every other row once, in batches of 256"
    assert summary["samples_per_s"] == summary["train_samples_per_s"] > 0
    # what the served model's checkpoint holds on disk: at least every table's rows, as floats
    checkpoint = JobFolder(config.path("train")).read_summary().checkpoint
    on_disk = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(checkpoint) for name in names)
    buckets = json.loads(next(config.path("features").glob("*/state.json")).read_text())["buckets"]
    table_rows = sum(count + 1 for count in buckets.values())  # hash mode: row 0 is the missing value
    assert summary["checkpoint_bytes"] == on_disk > table_rows * config.model.embedding_dim * 4


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
    assert metrics["checkpoint_bytes"] == summary["checkpoint_bytes"] > 0
    # the served model is judged calibrated; what the raw model read stays beside it
    assert 0.9 < metrics["eval_calibration"] < 1.1 and "eval_calibration_uncalibrated" in metrics
    calibrator = json.loads(Path(client.download_artifacts(run.info.run_id, "evaluation/calibrator.json")).read_text())
    assert "eval_ne_uncalibrated" in metrics and run.data.tags["evaluation.calibration"] == calibrator["method"]
    assert calibrator["rows"] == summary["calibration_rows"] and summary["calibrator"].split()[0] in ("Platt", "none")
    assert metrics["bayes_ne"] < metrics["eval_ne"] < 0.95 < metrics["baseline_constant_ne"] + 0.01
    assert run.data.params["training.nproc"] == "2"
    assert run.data.params["model.bottom_mlp"] == "[32, 8]"
    history = client.get_metric_history(run.info.run_id, "train_window_ne")
    assert len(history) >= 5 and history[-1].step > history[0].step
    heldout = client.get_metric_history(run.info.run_id, "heldout_ne")
    assert len(heldout) >= 2 and all(0 < m.value < 2 for m in heldout)
    assert client.get_metric_history(run.info.run_id, "train_total_steps") == [], "a record's total is no metric"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "training")}
    folder = JobFolder(config.path("train"))
    assert {f"training/{path.name}" for path in (*folder.plan_files, folder.summary_file)} <= artifacts
    tags = run.data.tags
    assert (tags["training.world_size"], tags["training.device"]) == ("2", "cpu")
    assert tags["training.precision"] in ("fp32", "bf16")
    assert not [tag for tag in tags if tag.split(".")[-1] in ("embedding_update", "matmul", "interaction", "malloc")]
    documents = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/report.md", "evaluation/slices.json", "evaluation/per_day.json"} <= documents
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/ne_curve.png", "plots/reliability.png"} <= plots
    assert run.info.artifact_uri.startswith(str(config.path("mlartifacts"))), "artifacts stay in the run folder"


def test_the_mlflow_run_spans_the_pipeline_and_the_summary_links_it(pipeline_run) -> None:
    config, summary = pipeline_run
    run = MlflowClient(tracking_uri=config.tracking_uri).get_run(summary["mlflow_run_id"])
    # the run starts when the pipeline starts (not once training is over), ends when it ends
    assert CALLED["at_ms"] <= run.info.start_time <= CALLED["at_ms"] + 15_000
    assert run.info.end_time <= CALLED["returned_ms"]
    assert (run.info.end_time - run.info.start_time) / 1000 >= run.data.metrics["train_seconds"]
    expected = f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert summary["mlflow_run_url"] == expected, "a local store: the page of the `mlflow ui` the summary prints"


def test_model_is_registered_loads_and_becomes_champion(pipeline_run) -> None:
    config, summary = pipeline_run
    client = MlflowClient(tracking_uri=config.tracking_uri)
    versions = client.search_model_versions(f"name='{config.tracking.registered_model}'")
    assert summary["model_version"] in {str(v.version) for v in versions}
    assert summary["promoted"] and summary["promotion_reason"] == "no champion yet"
    champion = client.get_model_version_by_alias(config.tracking.registered_model, "champion")
    assert str(champion.version) == summary["model_version"]
    mlflow.set_tracking_uri(config.tracking_uri)
    uri = f"models:/{config.tracking.registered_model}@champion"
    info = mlflow.models.get_model_info(uri)
    assert set(info.flavors) == {"python_function"} and info.signature is not None
    requirements = Path(mlflow.pyfunc.get_model_dependencies(uri)).read_text()
    matched = matched_set(torch.__version__)
    assert {f"fbgemm-gpu-cpu=={matched.fbgemm}", f"torchrec=={matched.torchrec}"} <= set(requirements.split())


def test_the_champion_loads_without_this_project_and_scores_raw_lines_as_the_run_did(
    pipeline_run, tmp_path: Path
) -> None:
    config, summary = pipeline_run
    lines, expected = raw_lines(config, 2), run_predictions(config, 2)
    assert summary["rows_quarantined"] == 0 and len(lines) == len(expected) == 6000
    scores = champion_scores_elsewhere(config, lines, tmp_path)
    assert scores.shape == expected.shape
    assert np.abs(scores - expected).max() <= 1e-6
    assert 0.05 < scores.std(), "real predictions, not a constant"


def test_mlflow_models_serve_scores_the_champion_over_http(pipeline_run, tmp_path: Path) -> None:
    config, _ = pipeline_run
    python = make_foreign_python(tmp_path / "venv")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "MLFLOW_TRACKING_URI": config.tracking_uri, "PYTHONPATH": "",
                   "PATH": f"{python.parent}:/usr/bin:/bin"}  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [python, "-m", "mlflow", "models", "serve", "-m", f"models:/{config.tracking.registered_model}@champion",
         "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
        cwd=tmp_path, env=environment, stdout=subprocess.DEVNULL, stderr=log,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        lines = raw_lines(config, 2)[:50]
        answer = httpx.post(f"{url}/invocations", json={"dataframe_split": {"columns": ["line"],
                            "data": [[line] for line in lines]}}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
        served = np.array(answer.json()["predictions"])
        assert np.abs(served - run_predictions(config, 2)[:50]).max() <= 1e-6
        refused = httpx.post(f"{url}/invocations", json={"dataframe_split": {"columns": ["line"], "data": [["1\t2"]]}},
                             timeout=60)  # fmt: skip
        assert refused.status_code == 400 and "2 tab-separated fields" in refused.text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def test_rerun_reuses_ingested_days(prefect_server, pipeline_run) -> None:
    from flows.deployments.pipeline import run_pipeline

    config, first = pipeline_run
    again = run_pipeline(str(ROOT / "configs" / "tiny.toml"), [f'run_dir="{config.run_dir}"'])
    assert again["rows_ingested"] == first["rows_ingested"]
    assert first["days_already_ingested"] == [] and again["days_already_ingested"] == [0, 1, 2], "no work redone"
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
        # Other modules' pipelines publish the same keys on the shared server: only this module's run counts.
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        ours = [a for a in found if CALLED["at_ms"] <= a.created.timestamp() * 1000 <= CALLED["returned_ms"]]
        return max(ours, key=lambda a: a.created) if ours else None

    summary = asyncio.run(latest("pipeline-summary"))
    assert summary is not None and "logistic_regression" in summary.data and "| **all** |" in summary.data
    table = asyncio.run(latest("evaluation-by-day"))
    assert table is not None and table.type == "table"
    plan = asyncio.run(latest("sharding-plan"))
    assert plan is not None and "t_C1" in plan.data and "table_wise" in plan.data
    progress = asyncio.run(latest("training-progress"))
    assert progress is not None and progress.type == "progress" and float(progress.data) == 100.0
    tuning = asyncio.run(latest("tuning-decision"))
    assert tuning is not None and "training.embedding_lr" in tuning.data


def test_the_reference_chooses_its_l2_as_the_config_says_and_the_log_tells_how(pipeline_run) -> None:
    """tiny.toml's `evaluation.reference_folds = 1`: the regression's L2 chosen on one hashed
    slice of the training rows, not cross-validated (the default on few rows, checked against
    scikit-learn in tests/unit/training/test_reference.py); the run's log says which."""
    import asyncio
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp

    def moment(ms: float) -> datetime:
        return datetime.fromtimestamp(ms / 1000, tz=UTC)

    async def messages() -> list[str]:
        during = LogFilter(timestamp=LogFilterTimestamp(after_=moment(CALLED["at_ms"]), before_=moment(CALLED["returned_ms"])))
        async with get_client() as client:
            return [log.message for log in await client.read_logs(log_filter=during)]

    said = [line for line in asyncio.run(messages()) if line.startswith("logistic regression: ")]
    config, summary = pipeline_run
    assert config.evaluation.reference_folds == 1 and len(said) == 1, said
    assert " chosen on " in said[0] and "held-out training rows" in said[0] and "cross-validation" not in said[0], said
    assert f"refit on all {summary['rows_trained']:,}" in said[0], said


def test_stages_run_as_subflows_of_the_pipeline(pipeline_run) -> None:
    import asyncio

    from prefect.client.orchestration import get_client

    async def runs():
        async with get_client() as client:
            return await client.read_flow_runs()

    everything = asyncio.run(runs())
    pipelines = [r for r in everything if r.parent_task_run_id is None and r.state.is_completed()]
    assert pipelines, "a completed top-level pipeline run"
    subflows = {r.name: r for r in everything if r.parent_task_run_id is not None}
    flow_names = set()

    async def flow_name(flow_id):
        async with get_client() as client:
            return (await client.read_flow(flow_id)).name

    for run in subflows.values():
        flow_names.add(asyncio.run(flow_name(run.flow_id)))
    assert {"ingest", "preprocess", "train", "evaluate"} <= flow_names


@pytest.mark.launcher
def test_a_killed_worker_fails_the_train_task_which_prefect_retries_from_the_checkpoint(
    prefect_server, tiny_features, tmp_path: Path
) -> None:
    from prefect import flow
    from test_checkpoint_recovery import _kill_one_worker_after

    from flows.run.feature_files import Features
    from flows.run.job import TrainedModel, build_job
    from flows.stages.train import train_task

    state, files = tiny_features
    features = Features(state, files, [])
    config = load_config(ROOT / "configs" / "tiny.toml", [f'run_dir="{tmp_path}"', "training.checkpoint_every=10",
                                                          "training.epochs=2"])  # fmt: skip

    @flow
    def train_once() -> tuple[TrainedModel, str]:
        from prefect.runtime import flow_run

        job = build_job(config, features)  # the folder the task trains in: its fingerprint
        _kill_one_worker_after(job, step=25)  # during the task's first attempt
        state_ = train_task(config, features, return_state=True)
        return state_.result(), str(flow_run.id)

    trained, flow_run_id = train_once()
    summary = trained.summary
    assert summary.resumed_from_step >= 20, "the retry resumed from a checkpoint"
    # the job's rows: the training days less the calibrator's held-out rows (flows/run/rows.py)
    trained_files = build_job(config, features).train_files
    given = sum(pq.ParquetFile(f).metadata.num_rows for f in trained_files)
    assert 0.85 * 12_000 < given < 0.95 * 12_000
    assert summary.rows_trained == given * config.training.epochs, "each training row once an epoch"

    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def task_runs():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    (train,) = [r for r in asyncio.run(task_runs()) if r.name.startswith("train")]
    assert train.run_count == 2 and train.state.is_completed(), "failed once, retried by Prefect, completed"
