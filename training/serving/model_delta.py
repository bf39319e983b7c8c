"""A served model's delta: what changed from one registered version's served model (A) to
another's (B), in a folder a served A can apply (`ChampionModel.apply_delta`) to score as B.

- `rows.parquet`: each table row whose floats differ between A and B (compared by their
  bits): table, row, B's values;
- `dense.parquet`: every other tensor of B's state (the MLPs), whole, as bytes;
- B's `model.json` (calibration, preprocessing, shape) and `vocabularies.npz` (vocab and
  managed modes: the admitted and evicted ids travel with it), as they are;
- `delta.json`: the versions, the rows per table, the bytes.

A and B must have the same shape (tables and MLPs); another shape is a new model to serve
whole.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from training.loop.delta_checkpoint import BITS
from training.serving.champion_pyfunc import DELTA_DENSE, DELTA_FORMAT, DELTA_MANIFEST, DELTA_ROWS


class DeltaRefused(ValueError):
    """Two served models no delta can join (another shape); the message says what to do."""


@dataclass(frozen=True)
class ModelDelta:
    rows_changed: int
    table_rows: int
    dense_tensors: int
    bytes: int


def is_table(name: str) -> bool:
    """A DLRM state's entry that is an embedding table."""
    return ".embedding_bags." in name and name.endswith(".weight")


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Rows whose bits differ (a float compared by value would take -0.0 for 0.0)."""
    bits = BITS[after.element_size()]
    return torch.nonzero((before.contiguous().view(bits) != after.contiguous().view(bits)).any(dim=1)).flatten()


def rows_table(rows: dict[str, np.ndarray]) -> pa.Table:
    """Table rows as columns `table` (each row's table: an index into the names, one string a
    table, not a row) and `row`, the tables in `rows`' order."""
    names = pa.array(list(rows), pa.string())
    table_of = pa.DictionaryArray.from_arrays(pa.array(np.repeat(np.arange(len(rows)), [len(r) for r in rows.values()]),
                                                       pa.int32()), names)  # fmt: skip
    numbers = np.concatenate(list(rows.values())) if rows else np.empty(0, np.int64)
    return pa.table({"table": table_of, "row": pa.array(numbers, pa.int64())})


def write_model_delta(served_a: Path, served_b: Path, out: Path, manifest: dict) -> ModelDelta:
    """Write the delta that takes the served model in `served_a` to the one in `served_b`
    (folders holding `dlrm.pt` and `model.json`) into `out`; `manifest` names the versions."""
    a_shape = json.loads((served_a / "model.json").read_text())["dlrm"]
    b_shape = json.loads((served_b / "model.json").read_text())["dlrm"]
    if a_shape != b_shape:
        raise DeltaRefused(f"the two versions have different shapes ({a_shape} → {b_shape}): no delta joins "
                           "them; serve the new version whole")  # fmt: skip
    a_state = torch.load(served_a / "dlrm.pt", map_location="cpu", weights_only=True)
    b_state = torch.load(served_b / "dlrm.pt", map_location="cpu", weights_only=True)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, np.ndarray] = {}
    values, dense = [], []
    for name, after in b_state.items():
        if is_table(name):
            changed = changed_rows(a_state[name], after)
            rows[name] = changed.numpy()
            values.append(after[changed].float().numpy())
        else:
            data = after.contiguous().view(torch.uint8).numpy().tobytes()
            dense.append({"name": name, "dtype": str(after.dtype).removeprefix("torch."), "shape": list(after.shape),
                          "data": data})  # fmt: skip
    per_table = {name: len(changed) for name, changed in rows.items()}
    widths = {int(b_state[name].shape[1]) for name in per_table}
    if len(widths) > 1:
        raise DeltaRefused(f"tables of several widths {sorted(widths)}: not a DLRM's")
    flat = pa.array(np.concatenate([block.reshape(-1) for block in values]) if values else [], pa.float32())
    row_values = pa.FixedSizeListArray.from_arrays(flat, widths.pop() if widths else 1)
    pq.write_table(rows_table(rows).append_column("values", row_values), out / DELTA_ROWS)
    pq.write_table(pa.Table.from_pylist(dense, schema=pa.schema([("name", pa.string()), ("dtype", pa.string()),
                                                                  ("shape", pa.list_(pa.int64())), ("data", pa.binary())])),
                   out / DELTA_DENSE)  # fmt: skip
    shutil.copy2(served_b / "model.json", out / "model.json")
    if (served_b / "vocabularies.npz").is_file():
        shutil.copy2(served_b / "vocabularies.npz", out / "vocabularies.npz")
    table_rows = sum(int(b_state[name].shape[0]) for name in per_table)
    written = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
    delta = ModelDelta(sum(per_table.values()), table_rows, len(dense), written)
    (out / DELTA_MANIFEST).write_text(json.dumps({"format": DELTA_FORMAT, **manifest, "dlrm": b_shape,
                                                  "rows_changed": per_table, "table_rows": table_rows,
                                                  "dense_tensors": len(dense)}, indent=1))  # fmt: skip
    return delta
