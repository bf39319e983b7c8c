"""MLflow outages: training never waits for the tracking server, and no run is lost to one.

Training writes its metrics locally (the job folder's metrics file) and the run is logged once it is done.
If the tracking server is unreachable then, the pipeline warns and waits for it (up to
`tracking.outage_wait_s`); if it stays away, the whole record (metrics, history, params,
artifacts, model) is written to `<run_dir>/mlflow-pending/`, and the next run uploads it
before logging its own.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import requests
from mlflow.exceptions import MlflowException

from flows.tracking.runs import RunRecord, TrackedRun, log_pipeline_run
from training.serving.export import ServingModel

PENDING = "mlflow-pending"
OUTAGE_ERRORS = (MlflowException, requests.RequestException, httpx.HTTPError, OSError)


def reachable(tracking_uri: str) -> bool:
    """A local store is always there; a server answers its health check."""
    if not tracking_uri.startswith(("http://", "https://")):
        return True
    try:
        return httpx.get(f"{tracking_uri.rstrip('/')}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_tracking(tracking_uri: str, wait_s: float, log: Any) -> bool:
    """True once the server answers; False if it did not within `wait_s`."""
    if reachable(tracking_uri):
        return True
    log.warning("MLflow at %s is unreachable; the finished run waits up to %.0f s for it", tracking_uri, wait_s)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(2)
        if reachable(tracking_uri):
            log.info("MLflow at %s is back; logging the run", tracking_uri)
            return True
    return False


def defer_run(run_dir: Path, record: RunRecord, model: ServingModel | None) -> Path:
    """Write the record, copies of its artifact files and the model where the next run finds them."""
    folder = run_dir / PENDING / f"{time.strftime('%Y%m%d-%H%M%S')}-{record.run_name}"
    files = folder / "artifacts"
    copied: dict[str, list[Path]] = {}
    for artifact_folder, paths in record.artifacts.items():  # the next run overwrites the originals
        target = files / artifact_folder
        target.mkdir(parents=True, exist_ok=True)
        copied[artifact_folder] = [Path(shutil.copy2(p, target / p.name)) for p in paths if p.exists()]
    record = replace(record, artifacts=copied, tags={**record.tags, "tracking.deferred": "true"})
    (folder / "record.pkl").write_bytes(pickle.dumps(record))
    if model is not None:
        shutil.copytree(model.folder, folder / "model")
    (folder / "COMPLETE").touch()  # written last: a half-written folder is never uploaded
    return folder


def upload_pending(run_dir: Path, tracking_uri: str, artifact_location: str | None, experiment: str,
                   registered_model: str | None, log: Any) -> list[TrackedRun]:  # fmt: skip
    """Log every complete deferred run of this run folder, oldest first; remove each once logged."""
    uploaded = []
    for folder in sorted((run_dir / PENDING).glob("*/COMPLETE")):
        folder = folder.parent
        record: RunRecord = pickle.loads((folder / "record.pkl").read_bytes())
        model = ServingModel.load(folder / "model") if (folder / "model").is_dir() else None
        tracked = log_pipeline_run(tracking_uri, artifact_location, experiment, record, model, registered_model)
        shutil.rmtree(folder)
        log.info("uploaded the deferred run %s as MLflow run %s", record.run_name, tracked.run_id)
        uploaded.append(tracked)
    return uploaded


def track_or_defer(run_dir: Path, tracking_uri: str, artifact_location: str | None, experiment: str,
                   registered_model: str | None, wait_s: float, record: RunRecord, model: ServingModel | None,
                   log: Any | None = None) -> TrackedRun:  # fmt: skip
    """Log the run (after any deferred ones); on an outage, defer it. A deferred run has no
    model version, so it is not promoted; it is logged, and registered, when uploaded."""
    log = log or logging.getLogger(__name__)
    try:
        if not wait_for_tracking(tracking_uri, wait_s, log):
            raise ConnectionError(f"MLflow at {tracking_uri} did not come back within {wait_s:.0f} s")
        upload_pending(run_dir, tracking_uri, artifact_location, experiment, registered_model, log)
        return log_pipeline_run(tracking_uri, artifact_location, experiment, record, model, registered_model)
    except (*OUTAGE_ERRORS, ConnectionError) as error:
        folder = defer_run(run_dir, record, model)
        log.warning("MLflow is unreachable (%s): the run is saved in %s and the next run uploads it; "
                    "nothing is lost", error, folder)  # fmt: skip
        return TrackedRun(f"deferred:{folder.name}", "", None)
