"""The registered model as an MLflow pyfunc: raw rows in, click probabilities out.

MLflow loads this file as the model's code ("models from code"), with `stock_dlrm.py`,
`id_hash.py`, `cross_ids.py`, `count_bins.py` and `calibration.py` bundled beside it, so it
imports nothing else of this project: numpy, pandas, pyarrow, torch, torchrec and mlflow only. Its artifact folder holds
the DLRM's state dict (`dlrm.pt`), its shape, the run's preprocessing state and its
calibrator (`model.json`), and in vocab mode the vocabularies (`vocabularies.npz`; in managed
mode the same file holds each table's admitted raw ids and their rows as training left them).

Input, for a model of Criteo data, a DataFrame with either
- a column `line`: raw Criteo TSV lines (label, I1..I13, C1..C26; the label may be left out), or
- the 39 named columns I1..I13 (integers; missing as None/NaN) and C1..C26 (8 hex characters,
  or the number they spell; missing as ""/None/NaN; a multi-hot feature as comma-separated
  ids or a list).
For a model of a Parquet source (`data.source = "parquet"`): its dense and id columns by
their warehouse names; ids as the warehouse holds them (integers, or text), a multi-hot
feature's as a list; missing as None/NaN.
Output: each row's click probability, calibrated as the run's report was, in input order.

The features are those of the run's preprocessing (ingestion/preprocess.py), here in numpy:
dense x → ln(1 + max(x, 0)) with missing → 0; a categorical id v → 1 + v mod buckets (hash
mode) or its vocabulary row, 1 when unseen (vocab mode); missing → 0; in managed mode the
row training admitted the id to, the table's last row otherwise, and missing is the id
−2^63; each id of a multi-hot bag maps alike and an empty bag is [missing]. A crossed pair
of features (`model.crosses`) adds one more id per row, computed from the two rows as
training's reader computes it (`cross_ids.py`); so does a count cut into bins
(`model.count_bins`): its dense value's bin (`count_bins.py`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

try:  # the copies bundled with the model (MLflow puts code_paths on sys.path)
    from calibration import Calibrator
    from count_bins import bin_rows, count_bins_from
    from cross_ids import cross_rows, crosses_from
    from id_hash import hash_texts
    from stock_dlrm import SERVING_FORMAT, build_stock_dlrm
except ModuleNotFoundError:  # this file imported from within the project
    from evaluation.calibration import Calibrator
    from ingestion.count_bins import bin_rows, count_bins_from
    from ingestion.cross_ids import cross_rows, crosses_from
    from ingestion.id_hash import hash_texts
    from training.model.stock_dlrm import SERVING_FORMAT, build_stock_dlrm

log = logging.getLogger(__name__)
DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
MISSING_ROW, OOV_ROW = 0, 1
MISSING_ID = -(2**63)  # managed mode's id of a missing value (ingestion/preprocess.py)
DEVICE_VARIABLE = "DLRM_SERVING_DEVICE"  # overrides the device chosen at export: cpu | cuda
_HEX_ID = re.compile(r"[0-9a-fA-F]{8}")
_CHUNK = 8192  # rows scored at once


class BadInput(ValueError):
    """A row that cannot be scored; says which and why (MLflow's server answers 400)."""


def lines_to_columns(lines: pd.Series) -> pd.DataFrame:
    """Raw Criteo lines → the 39 named feature columns as strings (a leading label dropped)."""
    text = lines.astype(str).str.replace(r"^\ufeff|\r?\n?$", "", regex=True)
    fields = text.str.count("\t") + 1
    wrong = np.flatnonzero(~fields.isin([39, 40]).to_numpy())
    if len(wrong):
        row = int(wrong[0])
        raise BadInput(f"row {row}: {int(fields.iloc[row])} tab-separated fields; a Criteo line has 40 "
                       "(label, I1..I13, C1..C26) or 39 (without the label)")  # fmt: skip
    text = text.where(fields == 39, text.str.split("\t", n=1).str[1])
    columns = text.str.split("\t", expand=True)
    columns.columns = [*DENSE, *SPARSE]
    return columns


def dense_features(frame: pd.DataFrame, names: Sequence[str] = DENSE) -> np.ndarray:
    """[rows, D] float32: ln(1 + max(x, 0)), missing → 0."""
    out = np.empty((len(frame), len(names)), dtype=np.float32)
    for j, name in enumerate(names):
        raw = frame[name] if pd.api.types.is_numeric_dtype(frame[name]) else frame[name].mask(frame[name] == "")
        values = pd.to_numeric(raw, errors="coerce")
        bad = values.isna() & raw.notna()
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise BadInput(f"row {row}: {name} = {raw.iloc[row]!r} is not a number")
        counts = values.fillna(0).to_numpy(dtype=np.float64)
        out[:, j] = np.log(1.0 + np.maximum(counts, 0.0))
    return out


def categorical_ids(values: Sequence[Any], feature: str, multi_hot: bool, id_type: str = "") -> list[list[int]]:
    """Each row's ids (an empty list when missing): Criteo hex text or numbers (`id_type`
    ""), integers ("int"), or text hashed as at ingestion ("string")."""
    if id_type:
        return _typed_ids(values, feature, multi_hot, id_type)
    rows = []
    for row, value in enumerate(values):
        if isinstance(value, str):
            items: Sequence[Any] = [v for v in value.split(",")] if multi_hot and value else [value] if value else []
        elif value is None or (isinstance(value, float) and np.isnan(value)):
            items = []
        elif multi_hot and isinstance(value, (list, tuple, np.ndarray)):
            items = list(value)
        else:
            items = [value]
        rows.append([_id_of(item, feature, row) for item in items])
    if not multi_hot and any(len(ids) > 1 for ids in rows):
        raise BadInput(f"{feature}: one id a row (it is not a multi-hot feature)")
    return rows


def _typed_ids(values: Sequence[Any], feature: str, multi_hot: bool, id_type: str) -> list[list[int]]:
    bags: list[list[Any]] = []
    for row, value in enumerate(values):
        if value is None or (isinstance(value, float) and np.isnan(value)):
            bags.append([])
        elif isinstance(value, (list, tuple, np.ndarray)):
            if not multi_hot:
                raise BadInput(f"row {row}: {feature} holds a list, but it is not a multi-hot feature")
            bags.append([item for item in value if item is not None])
        else:
            bags.append([value])
    flat = [item for bag in bags for item in bag]
    if id_type == "string":
        wrong = next((item for item in flat if not isinstance(item, str)), None)
        if wrong is not None:
            raise BadInput(f"{feature} = {wrong!r}: this feature's ids are text")
        ids = hash_texts(flat).tolist()
    else:
        ids = []
        for item in flat:
            if isinstance(item, (str, bytes, bool)) or int(item) != item:
                raise BadInput(f"{feature} = {item!r}: this feature's ids are integers")
            ids.append(int(item))
    out, at = [], 0
    for bag in bags:
        out.append(ids[at : at + len(bag)])
        at += len(bag)
    return out


def _id_of(item: Any, feature: str, row: int) -> int:
    if isinstance(item, str):
        if not _HEX_ID.fullmatch(item):
            raise BadInput(f"row {row}: {feature} = {item!r} is not 8 hex characters")
        return int(item, 16)
    number = int(item)
    if number != item or not 0 <= number < 2**32:
        raise BadInput(f"row {row}: {feature} = {item!r} is not a 32-bit id")
    return number


class FeatureMap:
    """A categorical id → its embedding row, as the run's preprocessing state maps it."""

    def __init__(self, preprocessing: dict[str, Any], vocabularies: dict[str, np.ndarray]) -> None:
        self.mode: str = preprocessing["mode"]
        self.buckets: dict[str, int] = preprocessing["buckets"]
        self.multi_hot: set[str] = set(preprocessing["multi_hot"])
        self.dense: tuple[str, ...] = tuple(preprocessing.get("dense", DENSE))
        self.sparse: tuple[str, ...] = tuple(self.buckets)
        self.id_types: dict[str, str] = preprocessing.get("id_types", {})
        self.crosses = crosses_from(preprocessing.get("crosses", ()))
        self.count_bins = count_bins_from(preprocessing.get("count_bins", ()))
        self.vocabularies = vocabularies  # "<feature>.values" (sorted), "<feature>.rows"

    def rows(self, feature: str, ids: np.ndarray) -> np.ndarray:
        if self.mode == "hash":  # numpy's mod is non-negative, as the SQL's for signed ids
            return 1 + np.mod(ids, self.buckets[feature])
        # vocab: unseen ids share row 1; managed: ids without a row share the table's last
        unseen = OOV_ROW if self.mode == "vocab" else self.buckets[feature] - 1
        values, rows = self.vocabularies[f"{feature}.values"], self.vocabularies[f"{feature}.rows"]
        at = np.minimum(np.searchsorted(values, ids), max(len(values) - 1, 0))
        found = (values[at] == ids) if len(values) else np.zeros(len(ids), dtype=bool)
        return np.where(found, rows[at] if len(values) else unseen, unseen)

    def feature_rows(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """A batch of feature files' ids (managed mode: raw ids) as this model's table rows,
        its crosses added."""
        if self.mode != "managed":
            return self.with_crosses(kjt)
        rows = [torch.from_numpy(self.rows(feature, jagged.values().numpy())) for feature, jagged in kjt.to_dict().items()]
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(rows), lengths=kjt.lengths(), stride=kjt.stride())

    def with_crosses(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """`kjt` (one id a row of each crossed feature) with each cross's rows keyed after its own."""
        if not self.crosses:
            return kjt
        ids = {feature: jagged.values().numpy() for feature, jagged in kjt.to_dict().items()}
        crossed = [cross_rows(ids[c.first], ids[c.second], c.rows) for c in self.crosses]
        return _with_one_id_columns(kjt, [c.name for c in self.crosses], crossed)

    def missing_row(self, feature: str) -> int:
        """The row of a missing value: row 0, or in managed mode the row of the id standing
        for it (`MISSING_ID`), as preprocessing writes it."""
        if self.mode != "managed":
            return MISSING_ROW
        return int(self.rows(feature, np.array([MISSING_ID], dtype=np.int64))[0])

    def with_count_bins(self, kjt: KeyedJaggedTensor, dense: np.ndarray) -> KeyedJaggedTensor:
        """`kjt` with each count's bin (of `dense`, [rows, D] as the model sees it) keyed after the rest."""
        if not self.count_bins:
            return kjt
        binned = [bin_rows(dense[:, self.dense.index(b.feature)], b.edges) for b in self.count_bins]
        return _with_one_id_columns(kjt, [b.name for b in self.count_bins], binned)

    def kjt(self, frame: pd.DataFrame, dense: np.ndarray | None = None) -> KeyedJaggedTensor:
        """The rows' KeyedJaggedTensor: keys the categorical features, every example at least
        one id (0: missing); then the crosses' and the count bins' (of `dense`, the rows'
        `dense_features`; worked out here when not given)."""
        values, lengths = [], []
        for feature in self.sparse:
            bags = categorical_ids(frame[feature].tolist(), feature, feature in self.multi_hot, self.id_types.get(feature, ""))
            sizes = np.fromiter(map(len, bags), dtype=np.int64, count=len(bags))
            mapped = self.rows(feature, np.fromiter((i for bag in bags for i in bag), dtype=np.int64))
            starts = np.cumsum(sizes) - sizes
            values.append(np.insert(mapped, starts[sizes == 0], self.missing_row(feature)))  # an empty bag: [missing]
            lengths.append(np.maximum(sizes, 1))
        crossed = self.with_crosses(KeyedJaggedTensor(
            keys=list(self.sparse), values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)), stride=len(frame)))  # fmt: skip
        if not self.count_bins:
            return crossed
        return self.with_count_bins(crossed, dense_features(frame, self.dense) if dense is None else dense)


def _with_one_id_columns(kjt: KeyedJaggedTensor, names: Sequence[str], columns: Sequence[np.ndarray]) -> KeyedJaggedTensor:
    """`kjt` with `columns` ([rows] int64 each, one id a row) keyed `names` after its own keys."""
    ones = torch.ones(len(columns) * kjt.stride(), dtype=kjt.lengths().dtype)
    return KeyedJaggedTensor(keys=[*kjt.keys(), *names], values=torch.cat([kjt.values(), *map(torch.from_numpy, columns)]),
                             lengths=torch.cat([kjt.lengths(), ones]), stride=kjt.stride())  # fmt: skip


def serving_device(chosen_at_export: str) -> torch.device:
    """`DLRM_SERVING_DEVICE` if set, else the export's choice; CUDA only where there is one."""
    wanted = os.environ.get(DEVICE_VARIABLE, chosen_at_export)
    if wanted == "cuda" and not torch.cuda.is_available():
        log.warning("the model was exported for CUDA but this host has no GPU: serving on the CPU")
        return torch.device("cpu")
    return torch.device(wanted)


# A served model's delta (`dlrm export-delta`, training/serving/model_delta.py writes it):
# the changed rows of each table, every other tensor whole, and the new version's
# `model.json` (calibration, preprocessing) and `vocabularies.npz` beside them.
DELTA_FORMAT = 1
DELTA_MANIFEST = "delta.json"
DELTA_ROWS = "rows.parquet"  # table, row, values (the row's floats)
DELTA_DENSE = "dense.parquet"  # name, dtype, shape, data (the tensor's bytes)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32}  # fmt: skip


def apply_model_delta(state: dict[str, torch.Tensor], folder: Path) -> None:
    """Write a delta's rows and dense tensors into a served model's state dict, in place."""
    rows = pq.read_table(folder / DELTA_ROWS)
    tables = rows.column("table").cast(pa.string())
    for table in pc.unique(tables).to_pylist():
        part = rows.filter(pc.equal(tables, table))
        target = state[table]
        values = np.asarray(part.column("values").combine_chunks().flatten(), dtype=np.float32)
        index = torch.tensor(part.column("row").to_numpy())  # a copy: Arrow's buffers are read-only
        target[index] = torch.tensor(values.reshape(len(index), -1)).to(target.dtype)
    for record in pq.read_table(folder / DELTA_DENSE).to_pylist():
        tensor = torch.frombuffer(bytearray(record["data"]), dtype=_DTYPES[record["dtype"]]).reshape(record["shape"])
        state[record["name"]] = tensor.clone()


class ChampionModel(mlflow.pyfunc.PythonModel):
    """Raw Criteo rows → click probabilities, with the run's own preprocessing and weights."""

    def load_context(self, context: Any) -> None:
        folder = Path(context.artifacts["model"])
        self._load(folder, torch.load(folder / "dlrm.pt", map_location="cpu", weights_only=True))

    def apply_delta(self, folder: str | Path) -> None:
        """Become the version a delta was exported to (`dlrm export-delta`): its changed table
        rows, its dense part, calibration and preprocessing over this model's state. The
        delta names the version it was taken against; it must be this one's shape."""
        folder = Path(folder)
        manifest = json.loads((folder / DELTA_MANIFEST).read_text())
        if manifest.get("format") != DELTA_FORMAT:
            raise ValueError(f"{folder}: delta format {manifest.get('format')} is not {DELTA_FORMAT}")
        if manifest["dlrm"] != self.shape:
            raise ValueError(f"{folder}: a delta of a model shaped {manifest['dlrm']}, not this model's {self.shape}")
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.dlrm.state_dict().items()}
        apply_model_delta(state, folder)
        self._load(folder, state)

    def _load(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """The model of `folder`'s description (`model.json`, `vocabularies.npz`) with `state`."""
        description = json.loads((folder / "model.json").read_text())
        if description.get("format") != SERVING_FORMAT:
            raise ValueError(f"model.json format {description.get('format')} is not {SERVING_FORMAT}: "
                             "load this model with the release that logged it")  # fmt: skip
        vocab_file = folder / "vocabularies.npz"
        vocabularies = dict(np.load(vocab_file)) if vocab_file.exists() else {}
        self.features = FeatureMap(description["preprocessing"], vocabularies)
        self.device = serving_device(description["device"])
        self.shape = description["dlrm"]
        dlrm = build_stock_dlrm(description["dlrm"], torch.device("cpu"))
        dlrm.load_state_dict(state)
        self.dlrm = dlrm.to(self.device).eval()
        self.calibrator = Calibrator.from_dict(description.get("calibration"))  # none logged: the identity

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> np.ndarray:
        frame = _as_frame(model_input)
        criteo = not self.features.id_types
        if "line" in frame.columns and criteo:
            frame = lines_to_columns(frame["line"])
        missing = [c for c in (*self.features.dense, *self.features.sparse) if c not in frame.columns]
        if missing and criteo:
            raise BadInput(f"the input needs a column 'line' (raw Criteo lines) or I1..I13 and C1..C26; missing {missing}")
        if missing:
            raise BadInput(f"the input needs the model's columns {[*self.features.dense, *self.features.sparse]}; "
                           f"missing {missing}")  # fmt: skip
        chunks = [self._score(frame.iloc[start : start + _CHUNK]) for start in range(0, len(frame), _CHUNK)]
        return np.concatenate(chunks) if chunks else np.empty(0)

    @torch.inference_mode()
    def _score(self, frame: pd.DataFrame) -> np.ndarray:
        dense = dense_features(frame, self.features.dense)
        logits = self.dlrm(torch.from_numpy(dense).to(self.device), self.features.kjt(frame, dense).to(self.device))  # [B, 1]
        return self.calibrator.apply(torch.sigmoid(logits.float()).reshape(-1).cpu().numpy().astype(np.float64))


def _as_frame(model_input: Any) -> pd.DataFrame:
    if isinstance(model_input, pd.DataFrame):
        return model_input.reset_index(drop=True)
    if isinstance(model_input, (list, pd.Series)):  # a list of raw lines
        return pd.DataFrame({"line": list(model_input)})
    raise BadInput(f"expected a DataFrame with a column 'line', got {type(model_input).__name__}")


mlflow.models.set_model(ChampionModel())
