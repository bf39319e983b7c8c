"""`dlrm export-delta`: the served-model delta between two registered versions, read from the
registry (training/serving/model_delta.py writes it; the served pyfunc applies it)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows.run.config import ConfigError, PipelineConfig
from flows.run.reports import DeltaReport
from flows.tracking.runs import tracking_client
from training.serving.model_delta import write_model_delta


def export_version_delta(config: PipelineConfig, from_version: str, to_version: str, out: Path) -> DeltaReport:
    """Write into `out` what takes version `from_version`'s served model to `to_version`'s."""
    name = config.tracking.registered_model
    client = tracking_client(config.tracking_uri)  # the registry the pipeline registers in: the tracking store's
    for version in (from_version, to_version):
        try:
            client.get_model_version(name, version)
        except MlflowException:
            known = sorted((int(v.version) for v in client.search_model_versions(f"name='{name}'")), reverse=True)
            raise ConfigError(f"version {version} of {name} is not in the registry at {config.tracking_uri} "
                              f"(its versions: {', '.join(map(str, known[:10])) or 'none'}); pass two of them") from None
    with tempfile.TemporaryDirectory(prefix="dlrm-delta-") as scratch:
        served = [_served_folder(config, client, name, version, Path(scratch) / version)
                  for version in (from_version, to_version)]  # fmt: skip
        delta = write_model_delta(*served, out, {"model": name, "from_version": from_version, "to_version": to_version})
    return DeltaReport(model=name, from_version=from_version, to_version=to_version, out=str(out),
                       rows_changed=delta.rows_changed, table_rows=delta.table_rows, dense_tensors=delta.dense_tensors,
                       bytes=delta.bytes)  # fmt: skip


def _served_folder(config: PipelineConfig, client: MlflowClient, name: str, version: str, scratch: Path) -> Path:
    """The folder of a version's served model (its `dlrm.pt` and `model.json`), downloaded."""
    scratch.mkdir(parents=True)
    where = client.get_model_version_download_uri(name, version)
    root = Path(mlflow.artifacts.download_artifacts(artifact_uri=where, dst_path=str(scratch),
                                                    tracking_uri=config.tracking_uri))  # fmt: skip
    found = sorted(path.parent for path in root.rglob("dlrm.pt"))
    if len(found) != 1:
        raise ConfigError(f"version {version} of {name} holds {len(found)} served models (dlrm.pt), not one: "
                          "it was not registered by this project's pipeline")  # fmt: skip
    return found[0]
