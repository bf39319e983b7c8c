"""MLflow outages lose no run (flows/tracking/deferred.py): a run that cannot reach the server
is written whole under the run folder and logged, tagged as deferred, by the next run that
can; a folder written halfway is never uploaded. The store the upload reaches is real
(SQLite); the unreachable server is a closed port."""

import logging
from pathlib import Path

from mlflow.tracking import MlflowClient

from flows.tracking.deferred import PENDING, track_or_defer, upload_pending
from flows.tracking.runs import RunRecord

CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens there


def _record(tmp_path: Path) -> RunRecord:
    artifact = tmp_path / "summary.json"
    artifact.write_text('{"ne": 0.81}')
    return RunRecord(run_name="night-3", params={"training.batch_size": 256}, config={"name": "tiny"},
                     metrics={"eval_ne": 0.81}, history=[], artifacts={"job": [artifact]})  # fmt: skip


def test_an_unreachable_server_defers_the_run_and_the_next_run_uploads_it(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", logging.getLogger(__name__)
    tracked = track_or_defer(run_dir, CLOSED_PORT, None, "outage", None, 0.0, _record(tmp_path), None, log)
    assert tracked.run_id.startswith("deferred:") and tracked.model_version is None, "no version: nothing promoted"
    pending = sorted((run_dir / PENDING).iterdir())
    assert len(pending) == 1 and (pending[0] / "COMPLETE").is_file() and (pending[0] / "artifacts/job/summary.json").is_file()
    (run_dir / PENDING / "half-written").mkdir()  # no COMPLETE marker: a run interrupted while deferring

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    uploaded = upload_pending(run_dir, store, str(tmp_path / "artifacts"), "outage", None, log)
    assert len(uploaded) == 1
    run = MlflowClient(store).get_run(uploaded[0].run_id)
    assert run.data.metrics["eval_ne"] == 0.81 and run.data.params["training.batch_size"] == "256"
    assert run.data.tags["tracking.deferred"] == "true" and run.info.run_name == "night-3"
    assert [p.name for p in (run_dir / PENDING).iterdir()] == ["half-written"], "uploaded once, then removed"
    assert upload_pending(run_dir, store, None, "outage", None, log) == [], "nothing uploaded twice"
