"""Turn a sharded training checkpoint into a plain model, and into the files the registered
model serves from (training/serving/champion_pyfunc.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torchrec.models.dlrm import DLRM

from evaluation.calibration import Calibrator
from ingestion.preprocess import PreprocessState, vocabulary_path
from training.job import TrainJob
from training.loop.checkpoint import load_unsharded
from training.model.build import build_train_model, dlrm_spec
from training.model.managed_ids import ManagedIds
from training.model.objective import RealRowsDLRMTrain, attach_managed_ids, managed_ids_of
from training.model.stock_dlrm import SERVING_FORMAT
from training.serving.model_delta import changed_rows, is_table, rows_table
from training.torch_range import matched_set

# The pyfunc's code, and the file it imports (MLflow code_paths): loaded by MLflow, not here.
CHAMPION_CODE = Path(__file__).with_name("champion_pyfunc.py")
CHAMPION_BUNDLED = (Path(__file__).parents[1] / "model" / "stock_dlrm.py", Path(__file__).parents[2] / "ingestion" / "id_hash.py",
                    Path(__file__).parents[2] / "ingestion" / "cross_ids.py",
                    Path(__file__).parents[2] / "ingestion" / "count_bins.py",
                    Path(__file__).parents[2] / "evaluation" / "calibration.py")  # fmt: skip
SERVING_DEVICES = ("cpu", "cuda")
# vocab and managed modes: each feature's ids with a row of their own ("<feature>.values",
# sorted) and their rows ("<feature>.rows"), beside the weights
VOCABULARIES = "vocabularies.npz"
# A warm start's record of what it changed in the model it continued: each table row whose
# floats differ (table, row), and the counts; what a serving tier pushes to move to it
ROWS_CHANGED, ROWS_CHANGED_RECORD = "rows_changed.parquet", "rows_changed.json"
# fbgemm's CPU build serves on CPU hosts, its CUDA build on GPU hosts: one or the other.
_FBGEMM = {"cpu": "fbgemm-gpu-cpu", "cuda": "fbgemm-gpu"}
# torchrec's metadata asks for the CUDA fbgemm and an old torchmetrics: install it with
# --no-deps beside these, its real needs (the README's "serving the champion").
_TORCHREC_NEEDS = ["tensordict==0.15.3", "torchmetrics==1.9.0", "pyre-extensions==0.0.32", "tqdm==4.70.1",
                   "iopath==0.1.9"]  # fmt: skip


def serving_stack(device: str, torch_version: str = torch.__version__) -> list[str]:
    """The served model's torch, fbgemm and TorchRec: the release that trained it and its set."""
    matched = matched_set(torch_version)
    return [f"torch=={matched.torch}", f"torchrec=={matched.torchrec}", *_TORCHREC_NEEDS,
            f"{_FBGEMM[device]}=={matched.fbgemm}"]  # fmt: skip


def export_model(job: TrainJob, checkpoint: Path) -> DLRM:
    """The trained DLRM, unsharded on CPU: forward(dense [B, 13], KJT) → logits [B, 1].

    It is TorchRec's own module (training/model/stock_dlrm.py builds it), nothing of this project.
    """
    return _load_trained(job, checkpoint).model.eval()


def export_managed_ids(job: TrainJob, checkpoint: Path) -> ManagedIds | None:
    """The trained run's managed-collision ids (None unless `job.managed_ids`)."""
    return managed_ids_of(_load_trained(job, checkpoint)) if job.managed_ids is not None else None


def _load_trained(job: TrainJob, checkpoint: Path) -> RealRowsDLRMTrain:
    model = build_train_model(job.model, job.table_sizes, torch.device("cpu"), job.dense_features)
    if job.managed_ids is not None:
        managed = job.managed_ids
        attach_managed_ids(model, ManagedIds(job.table_sizes, managed.policy, managed.admit_min_count))
    load_unsharded(model, checkpoint)
    return model


@dataclass(frozen=True)
class ServingModel:
    """The registered model's artifact folder (its code: CHAMPION_CODE, CHAMPION_BUNDLED)."""

    folder: Path
    device: str  # the serving device its requirements are for: cpu | cuda
    # a warm start's table rows that differ from the model it continued (ROWS_CHANGED); None: a fresh model
    rows_changed: int | None = None

    @property
    def requirements(self) -> list[str]:
        return serving_stack(self.device)

    @classmethod
    def load(cls, folder: Path) -> ServingModel:
        record = folder / ROWS_CHANGED_RECORD
        changed = json.loads(record.read_text())["rows_changed"] if record.is_file() else None
        return cls(folder, json.loads((folder / "model.json").read_text())["device"], changed)


def write_serving_model(job: TrainJob, checkpoint: Path, preprocessing: PreprocessState, features_root: Path,
                        folder: Path, device: str = "cpu", calibrator: Calibrator | None = None) -> ServingModel:  # fmt: skip
    """The weights, shape, preprocessing state and calibrator the pyfunc scores raw rows with;
    a warm start's also the rows it changed in the model it continued (ROWS_CHANGED)."""
    if device not in SERVING_DEVICES:
        raise ValueError(f"tracking.serving_device: {device!r} is not one of {list(SERVING_DEVICES)}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    trained = _load_trained(job, checkpoint)
    state = trained.model.eval().state_dict()
    torch.save(state, folder / "dlrm.pt")
    changed = _record_rows_changed(job, state, folder) if job.init_checkpoint else None
    if preprocessing.mode == "vocab":
        np.savez(folder / VOCABULARIES, **vocabulary_arrays(preprocessing, features_root))
    managed = managed_ids_of(trained)
    if managed is not None:  # the ids' rows as training left them, in the vocabularies' form
        np.savez(folder / VOCABULARIES, **managed_id_arrays(managed))
    description = {
        "format": SERVING_FORMAT,
        "device": device,
        "dlrm": dlrm_spec(job.model, job.table_sizes, job.dense_features),
        "preprocessing": {"state_id": preprocessing.state_id, "mode": preprocessing.mode, "buckets": preprocessing.buckets,
                          "multi_hot": sorted(preprocessing.multi_hot), "dense": list(preprocessing.dense),
                          "id_types": preprocessing.id_types, "crosses": [asdict(cross) for cross in job.crosses],
                          "count_bins": [asdict(bins) for bins in job.count_bins]},
        "calibration": (calibrator or Calibrator()).as_dict(),
    }
    (folder / "model.json").write_text(json.dumps(description, indent=2))
    return ServingModel(folder, device, changed)


def _record_rows_changed(job: TrainJob, state: dict[str, torch.Tensor], folder: Path) -> int | None:
    """Write which table rows of `state` differ, bit for bit, from the model the job started
    from (`init_checkpoint`): `rows_changed.parquet` (table, row) and the counts. None (no
    record) when the two do not have the same tables."""
    try:
        before = _load_trained(job, Path(job.init_checkpoint)).model.state_dict()
    except (RuntimeError, ValueError):  # a start of another shape (its tables do not load into these)
        return None
    tables = [name for name in state if is_table(name)]
    if any(name not in before or before[name].shape != state[name].shape for name in tables):
        return None
    rows = {name: changed_rows(before[name], state[name]).numpy() for name in tables}
    pq.write_table(rows_table(rows), folder / ROWS_CHANGED)
    total = int(sum(len(r) for r in rows.values()))
    (folder / ROWS_CHANGED_RECORD).write_text(json.dumps({
        "since": "the model this one continued (its training started from that model's checkpoint)",
        "rows_changed": total, "table_rows": int(sum(state[name].shape[0] for name in tables)),
        "by_table": {name: len(r) for name, r in rows.items()}}, indent=1))  # fmt: skip
    return total


def served_ids(folder: Path, feature: str) -> np.ndarray:
    """The ids of `feature` that have a row of their own in the model served from `folder`
    (vocab and managed modes), sorted."""
    with np.load(folder / VOCABULARIES) as arrays:
        return arrays[f"{feature}.values"]


def managed_id_arrays(managed: ManagedIds) -> dict[str, np.ndarray]:
    """Per feature, its resident raw ids (sorted) and their rows; any other id takes the
    table's last row."""
    arrays = {}
    for feature in managed.tables:
        resident = sorted(managed.id_rows(feature).items())
        arrays[f"{feature}.values"] = np.array([i for i, _ in resident], dtype=np.int64)
        arrays[f"{feature}.rows"] = np.array([r for _, r in resident], dtype=np.int64)
    return arrays


def vocabulary_arrays(state: PreprocessState, features_root: Path) -> dict[str, np.ndarray]:
    """Per feature, its vocabulary's values (sorted, for a binary search) and their rows."""
    arrays = {}
    for feature in state.buckets:
        table = pq.read_table(vocabulary_path(features_root, state, feature)).sort_by("value")
        arrays[f"{feature}.values"] = table["value"].to_numpy().astype(np.int64)
        arrays[f"{feature}.rows"] = table["index"].to_numpy().astype(np.int64)
    return arrays
