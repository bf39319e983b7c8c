"""MLflow outages lose nothing. A run that cannot reach its tracking server is saved
locally and uploaded by the next run; a server killed during training makes its run wait
and log every metric when the server returns. One lineage of two runs shows both, in the
order a user meets them. The servers are real (infra/mlflow-server.sh on a fresh PostgreSQL
database)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import warm_commands
from mlflow.tracking import MlflowClient
from ports import free_port
from services import ROOT, create_database, drop_database, start_mlflow, stop

from training.job import JobFolder
from training.loop.progress import TrainRecord, read_records

pytestmark = pytest.mark.slow


@pytest.fixture
def backend():
    name = f"dlrm_it_outage_{uuid.uuid4().hex[:6]}"
    url = create_database(name)
    yield url
    drop_database(name)


def _run(run_dir: Path, uri: str, wait_s: float, prefect_api: str) -> subprocess.Popen:
    overrides = [f'run_dir="{run_dir}"', f'tracking.tracking_uri="{uri}"', f"tracking.outage_wait_s={wait_s}",
                 'tuning.policy="off"', 'tracking.promotion_lock="postgresql://postgres@127.0.0.1:5432/postgres"']  # fmt: skip
    return subprocess.Popen(
        [*warm_commands.dlrm(), "run", "--config", "configs/tiny.toml", *[a for o in overrides for a in ("--set", o)],
         "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PREFECT_HOME": str(run_dir.parent / "prefect"), "PREFECT_API_URL": prefect_api},
    )  # fmt: skip


def _summary(lines: list[str]) -> dict:
    """The `--json` summary among the log lines."""
    return json.loads(next(line for line in reversed(lines) if line.startswith("{")))


def _logged_history(client: MlflowClient, run_id: str) -> int:
    return len(client.get_metric_history(run_id, "train_window_ne"))


def _local_history(run_dir: Path) -> int:
    return sum(isinstance(record, TrainRecord) for record in read_records(JobFolder(run_dir / "train").metrics))


def test_a_run_without_mlflow_is_uploaded_by_the_next_which_waits_out_a_server_killed_during_training(
    backend: str, prefect_server: str, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there yet
    uri = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    first = _run(run_dir, uri, wait_s=2, prefect_api=prefect_server)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-4000:]
    deferred = _summary(out.splitlines())
    assert deferred["mlflow_run_id"].startswith("deferred:") and deferred["model_version"] is None
    assert "the next run uploads it" in out
    assert len(list((run_dir / "mlflow-pending").glob("*/COMPLETE"))) == 1
    first_history = _local_history(run_dir)

    server = start_mlflow(tmp_path, port, backend, tmp_path / "mlflow.log")
    output: list[str] = []
    killed_at = restarted = None
    try:
        second = _run(run_dir, uri, wait_s=180, prefect_api=prefect_server)
        assert second.stdout is not None
        for line in second.stdout:
            output.append(line)
            if "[train] step" in line and killed_at is None:
                stop(server, signal.SIGKILL)  # mid-training
                killed_at = time.monotonic()
            if "is unreachable" in line and killed_at is not None and restarted is None:
                restarted = time.monotonic()  # the finished run waits: bring the server back
                server = start_mlflow(tmp_path, port, backend, tmp_path / "mlflow.log")
        assert second.wait() == 0, "".join(output)[-4000:]
        text = "".join(output)
        assert killed_at is not None and restarted is not None and restarted - killed_at < 170
        assert "MLflow at" in text, "a clear warning"
        assert "uploaded the deferred run" in text
        assert not list((run_dir / "mlflow-pending").glob("*/COMPLETE")), "uploaded once, then removed"
        summary = _summary(output)
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("dlrm-tiny").experiment_id])
        assert len(runs) == 2
        late = [r for r in runs if r.data.tags.get("tracking.deferred") == "true"]
        assert len(late) == 1 and late[0].data.metrics["eval_ne"] == pytest.approx(deferred["eval_ne"])
        assert _logged_history(client, late[0].info.run_id) == first_history
        plan_text = JobFolder(run_dir / "train").plan_files[0].name
        assert {a.path for a in client.list_artifacts(late[0].info.run_id, "training")} >= {f"training/{plan_text}"}
        run = client.get_run(summary["mlflow_run_id"])
        # the second run's metrics: its own local records (the folder's, rewritten by that run)
        assert _logged_history(client, run.info.run_id) == _local_history(run_dir) > 0, "no metric lost"
        assert run.data.metrics["eval_ne"] == pytest.approx(summary["eval_ne"])
        versions = {str(v.version) for v in client.search_model_versions("name='dlrm-ctr-tiny'")}
        assert versions == {"1", "2"}, "the deferred model is registered too"
        assert summary["model_version"] == "2", "registered after the deferred one it uploaded first"
    finally:
        stop(server)
