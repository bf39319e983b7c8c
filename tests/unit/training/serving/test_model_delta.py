"""A served model's delta (training/serving/model_delta.py), on two plain DLRM states: the
rows it finds changed, and A's state with it applied against B's, bit for bit."""

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from training.config import ModelConfig
from training.model.build import build_dlrm, dlrm_spec
from training.serving.champion_pyfunc import DELTA_ROWS, apply_model_delta
from training.serving.model_delta import DeltaRefused, changed_rows, is_table, write_model_delta

TABLES = {"C1": 50, "C2": 7, "C3": 300}
MODEL = ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])


def _served(folder: Path, state: dict[str, torch.Tensor], model: ModelConfig = MODEL) -> Path:
    folder.mkdir(parents=True)
    torch.save(state, folder / "dlrm.pt")
    (folder / "model.json").write_text(json.dumps({"dlrm": dict(dlrm_spec(model, TABLES, 13))}))
    return folder


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, set[int]]]:
    torch.manual_seed(0)
    before = {name: tensor.clone() for name, tensor in build_dlrm(MODEL, TABLES, torch.device("cpu"), 13).state_dict().items()}
    after = {name: tensor.clone() for name, tensor in before.items()}
    touched = {}
    for k, name in enumerate(n for n in after if is_table(n)):
        rows = {0, 3 + k, int(after[name].shape[0]) - 1}
        after[name][sorted(rows)] += 0.5
        touched[name] = rows
    after.update({name: tensor * 1.5 for name, tensor in after.items() if not is_table(name)})
    return before, after, touched


def test_the_delta_holds_the_changed_rows_and_takes_a_to_b_bit_for_bit(tmp_path: Path) -> None:
    before, after, touched = _states()
    delta = write_model_delta(_served(tmp_path / "a", before), _served(tmp_path / "b", after), tmp_path / "delta",
                              {"from_version": "1", "to_version": "2"})  # fmt: skip
    rows = pq.read_table(tmp_path / "delta" / DELTA_ROWS).to_pylist()
    found = {(r["table"], r["row"]) for r in rows}
    assert found == {(name, row) for name, changed in touched.items() for row in changed}
    assert delta.rows_changed == len(found) and delta.table_rows == sum(TABLES.values()) and delta.dense_tensors > 0
    for name, changed in touched.items():
        assert set(changed_rows(before[name], after[name]).tolist()) == changed
    state = {name: tensor.clone() for name, tensor in before.items()}
    apply_model_delta(state, tmp_path / "delta")
    for name, tensor in after.items():
        assert torch.equal(state[name].view(torch.uint8) if state[name].is_floating_point() else state[name],
                           tensor.view(torch.uint8) if tensor.is_floating_point() else tensor), name


def test_two_models_of_other_shapes_have_no_delta(tmp_path: Path) -> None:
    before, _, _ = _states()
    wider = dataclasses.replace(MODEL, bottom_mlp=[32, 8])
    other = build_dlrm(wider, TABLES, torch.device("cpu"), 13).state_dict()
    with pytest.raises(DeltaRefused, match="different shapes"):
        write_model_delta(_served(tmp_path / "a", before), _served(tmp_path / "b", other, wider), tmp_path / "d", {})
