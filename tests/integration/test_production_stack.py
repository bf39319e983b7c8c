"""The docker-compose stack's services, run natively with the same scripts against the
local PostgreSQL: the Prefect server and the MLflow server on fresh databases created by
infra/postgres/init.sql, the pipeline tracked on them, and a retrain started through the
Prefect API exactly as the UI's Run button starts it, served by `dlrm serve`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import warm_commands
from mlflow.tracking import MlflowClient
from ports import free_port
from services import POSTGRES, ROOT, base_env, start_service, stop, wait_for

pytestmark = pytest.mark.slow
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass(frozen=True)
class Stack:
    prefect_api: str
    mlflow_uri: str
    databases: dict[str, str]  # service → database name
    env: dict[str, str]  # a client's environment (PREFECT_API_URL, …)
    run_dir: Path

    def overrides(self) -> list[str]:
        optuna = f"postgresql://{POSTGRES}/{self.databases['optuna']}"
        return [f'run_dir="{self.run_dir}"', f'tracking.tracking_uri="{self.mlflow_uri}"',
                f'tracking.promotion_lock="{optuna}"', f'tuning.storage="{optuna}"', 'tuning.policy="off"']  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import psycopg

    home = tmp_path_factory.mktemp("stack")
    prefix = f"dlrm_it_{uuid.uuid4().hex[:6]}"
    init_sql = (ROOT / "infra" / "postgres" / "init.sql").read_text()
    statements = re.findall(r"CREATE DATABASE (\w+);", init_sql)
    databases = {name: f"{prefix}_{name}" for name in statements}
    admin = psycopg.connect(f"postgresql://{POSTGRES}/postgres", autocommit=True)
    for name, database in databases.items():  # init.sql's statements, under this test's prefix
        admin.execute(f"CREATE DATABASE {name};".replace(name, database))
    base = base_env(home)
    prefect_port, mlflow_port = free_port(), free_port()
    # as compose starts it: the URL built from the credentials (a password that needs
    # encoding; the server's trust auth accepts any), under this test's database prefix
    prefect = start_service("prefect-server.sh", {
        **base, "PREFECT_SERVER_API_PORT": str(prefect_port), "POSTGRES_USER": "postgres",
        "POSTGRES_PASSWORD": "p@ss/w:rd", "POSTGRES_HOST": POSTGRES.split("@")[1], "POSTGRES_DATABASE_PREFIX": f"{prefix}_",
    }, home / "prefect.log")  # fmt: skip
    mlflow = start_service("mlflow-server.sh", {
        **base, "MLFLOW_PORT": str(mlflow_port), "MLFLOW_WORKERS": "1",
        "MLFLOW_BACKEND_STORE_URI": f"postgresql://{POSTGRES}/{databases['mlflow']}",
        "MLFLOW_ARTIFACTS_DESTINATION": str(home / "mlartifacts"),
    }, home / "mlflow.log")  # fmt: skip
    try:
        api = f"http://127.0.0.1:{prefect_port}/api"
        wait_for(f"{api}/health", prefect, home / "prefect.log")
        wait_for(f"http://127.0.0.1:{mlflow_port}/health", mlflow, home / "mlflow.log")
        # PREFECT_RUNNER_POLL_FREQUENCY: `dlrm serve` picks up a run the UI starts within 2 s, not
        # Prefect's 10 (idle time in a test)
        env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home / "prefect-client"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_RUNNER_POLL_FREQUENCY": "2"}  # fmt: skip
        yield Stack(api, f"http://127.0.0.1:{mlflow_port}", databases, env, home / "run")
    finally:
        for process in (prefect, mlflow):
            stop(process)
        for name in databases.values():
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def _dlrm(stack: Stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*warm_commands.dlrm(), *args], cwd=ROOT, env=stack.env,
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def first_run(stack: Stack) -> dict:
    overrides = [arg for o in stack.overrides() for arg in ("--set", o)]
    result = _dlrm(stack, "run", "--config", "configs/tiny.toml", *overrides, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pipeline_is_tracked_on_the_mlflow_server_with_served_artifacts(stack: Stack, first_run: dict) -> None:
    client = MlflowClient(stack.mlflow_uri)
    run = client.get_run(first_run["mlflow_run_id"])
    assert run.data.metrics["eval_ne"] == pytest.approx(first_run["eval_ne"])
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), "artifacts go through the server"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} >= {"plots/ne_curve.png"}
    assert first_run["model_version"] == "1" and first_run["promoted"]
    flows = httpx.post(f"{stack.prefect_api}/flow_runs/filter", json={}, timeout=10).json()
    assert any(f["name"] and f["state_type"] == "COMPLETED" for f in flows), "the run is recorded in Prefect"


@pytest.fixture(scope="module")
def served(stack: Stack, first_run: dict) -> Iterator[dict]:
    """`dlrm serve` running, as the trainer service runs it; yields the retrain deployment."""
    overrides = [arg for o in stack.overrides() for arg in ("--set", o)]
    log = stack.run_dir.parent / "serve.log"
    server = subprocess.Popen([str(Path(sys.executable).parent / "dlrm"), "serve", "--config", "configs/tiny.toml",
                               *overrides], cwd=ROOT, env=stack.env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        yield {**_wait_for_deployment(stack, "retrain/retrain", server, log), "log": log}
    finally:
        os.killpg(server.pid, 2)
        try:
            # idle, it stops in ~5 s; in full test runs it sometimes sat out the whole wait
            # when the signal came just as a flow run ended (no "Pausing all deployments")
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def test_the_api_creates_a_retrain_with_the_deployments_parameters(stack: Stack, served: dict) -> None:
    """What the UI's Run → Quick run sends, from a script: a flow run of the deployment with
    its default parameters (scheduled a day ahead, so the trainer leaves it; the UI test
    below runs one to the end)."""
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    created = httpx.post(f"{stack.prefect_api}/deployments/{served['id']}/create_flow_run",
                         json={"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": tomorrow}}},
                         timeout=10)  # fmt: skip
    assert created.status_code == 201, created.text
    run = created.json()
    assert run["parameters"]["config_path"] == "configs/tiny.toml" and run["state"]["type"] == "SCHEDULED"
    assert run["parameters"]["overrides"] == served["parameters"]["overrides"]
    deleted = httpx.delete(f"{stack.prefect_api}/flow_runs/{run['id']}", timeout=10)
    assert deleted.status_code == 204, deleted.text


def test_the_server_schedules_the_nightly_deployments_runs(stack: Stack, served: dict) -> None:
    """The Prefect server's scheduler, on PostgreSQL, creates the upcoming runs of the
    `pipeline/nightly` deployment at its cron's times (the default `0 2 * * *`, UTC)."""
    nightly = httpx.get(f"{stack.prefect_api}/deployments/name/pipeline/nightly", timeout=5).json()
    deadline, runs = time.monotonic() + 150, []
    while time.monotonic() < deadline and not runs:
        runs = [r for r in _flow_runs_of(stack, nightly["id"]) if r["state_type"] == "SCHEDULED"]
        time.sleep(2)
    assert runs, "no scheduled run: see the scheduler's errors in " + str(stack.run_dir.parent / "prefect.log")
    for run in runs:
        start = datetime.fromisoformat(run["expected_start_time"]).astimezone(UTC)
        assert run["auto_scheduled"] and (start.hour, start.minute, start.second) == (2, 0, 0), run
        assert run["parameters"]["as_of"] == "newest", "each night runs as of the newest complete day"


def test_the_prefect_ui_run_button_starts_a_retrain_that_completes_and_registers_a_new_version(
    stack: Stack, served: dict, tmp_path: Path
) -> None:
    """Headless Debian Chromium, driven by Playwright: open the deployment, press Run."""
    from playwright.sync_api import sync_playwright

    chromium = Path("/usr/bin/chromium")
    assert chromium.is_file(), "Debian's chromium package is needed (.ci/run installs it)"
    before = {r["id"] for r in _flow_runs_of(stack, served["id"])}
    ui = stack.prefect_api.removesuffix("/api")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{ui}/deployments/deployment/{served['id']}", wait_until="networkidle")
            page.get_by_role("button", name="Run", exact=True).click()  # not the "Runs" menu entry
            page.get_by_text("Quick run", exact=True).click()
            page.get_by_text("scheduled", exact=False).first.wait_for(timeout=15_000)  # the UI's toast
            page.screenshot(path=str(tmp_path / "after-run.png"))
        finally:
            browser.close()
    new = [r for r in _flow_runs_of(stack, served["id"]) if r["id"] not in before]
    assert len(new) == 1, "one press of Run, one flow run"
    state = _wait_for_flow_run(stack, new[0]["id"], seconds=420)
    assert state == "COMPLETED", served["log"].read_text()[-4000:]
    client = MlflowClient(stack.mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("dlrm-tiny").experiment_id],
                             "tags.`pipeline.config` = 'tiny'", order_by=["attributes.start_time DESC"])[0]  # fmt: skip
    assert "eval_ne" in run.data.metrics
    versions = {str(v.version) for v in client.search_model_versions("name='dlrm-ctr-tiny'")}
    assert {"1", "2"} <= versions, "a new model version beside the first run's"


# As the machine's probe ran it: no background networking (this host has no internet).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def _flow_runs_of(stack: Stack, deployment_id: str) -> list[dict]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}}
    return httpx.post(f"{stack.prefect_api}/flow_runs/filter", json=body, timeout=10).json()


def _wait_for_deployment(stack: Stack, name: str, server: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"dlrm serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        answer = httpx.get(f"{stack.prefect_api}/deployments/name/{name}", timeout=5)
        if answer.status_code == 200:
            return answer.json()
        time.sleep(1)
    pytest.fail(f"deployment {name} was not registered:\n{log.read_text()[-3000:]}")


def _wait_for_flow_run(stack: Stack, flow_run_id: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = httpx.get(f"{stack.prefect_api}/flow_runs/{flow_run_id}", timeout=5).json()["state"]["type"]
        if state in TERMINAL:
            return state
        time.sleep(2)
    return "TIMED OUT"
