"""summary.json: written and read as one typed record, checked on load."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from training.summary import SchemaError, TrainSummary

SUMMARY = TrainSummary(
    steps=46, samples=11_520, seconds=0.5, samples_per_s=23_040.0, first_step_seconds=0.2, compiled=False,
    precision="fp32", cpu={"interaction": "native", "malloc": "retain"}, rows_trained=11_776,
    rows_fingerprint=2**64 - 5, resumed_from_step=0, world_size=2, device="cpu", backend="gloo",
    pipeline="plain", checkpoint="/runs/train/checkpoints/default/step-46", eval_rows_rank0=3000,
)  # fmt: skip


def _write(path: Path, **changes) -> Path:
    data = {**asdict(SUMMARY), **changes}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not ...}))
    return path


def test_a_saved_summary_loads_equal(tmp_path: Path) -> None:
    SUMMARY.save(tmp_path / "summary.json")
    assert TrainSummary.load(tmp_path / "summary.json") == SUMMARY
    on_gpu = replace(SUMMARY, cpu={}, device="cuda", backend="nccl")
    on_gpu.save(tmp_path / "summary.json")
    assert TrainSummary.load(tmp_path / "summary.json") == on_gpu
    assert not list(tmp_path.glob("*.staged")), "written whole, then renamed"


def test_the_json_keeps_the_names_other_tools_read(tmp_path: Path) -> None:
    SUMMARY.save(tmp_path / "summary.json")
    data = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "samples_per_s", "rows_trained", "resumed_from_step", "world_size", "device", "precision"):
        assert data[key] == getattr(SUMMARY, key)


def test_a_missing_field_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "summary.json", rows_trained=..., world_size=...)
    with pytest.raises(SchemaError, match=r"summary.json: TrainSummary is missing field\(s\) rows_trained, world_size"):
        TrainSummary.load(path)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("steps", "46", "TrainSummary.steps: expected int, got str '46'"),
        ("steps", 46.0, "TrainSummary.steps: expected int, got float 46.0"),
        ("world_size", True, "TrainSummary.world_size: expected int, got bool True"),
        ("compiled", 0, "TrainSummary.compiled: expected bool, got int 0"),
        ("samples_per_s", None, "TrainSummary.samples_per_s: expected float, got NoneType None"),
        ("cpu", ["native"], "TrainSummary.cpu: expected an object, got list"),
        ("cpu", {"interaction": 1}, "TrainSummary.cpu['interaction']: expected str, got int 1"),
    ],
)
def test_a_mistyped_field_is_named_with_its_value(tmp_path: Path, field: str, value, expected: str) -> None:
    with pytest.raises(SchemaError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        TrainSummary.load(_write(tmp_path / "summary.json", **{field: value}))


def test_whole_numbers_are_accepted_as_floats_and_unknown_keys_ignored(tmp_path: Path) -> None:
    loaded = TrainSummary.load(_write(tmp_path / "summary.json", seconds=2, added_later="x"))
    assert loaded.seconds == 2.0 and isinstance(loaded.seconds, float)


def test_a_file_that_is_not_json_says_so(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text('{"steps": 4')
    with pytest.raises(SchemaError, match="summary.json: not JSON"):
        TrainSummary.load(tmp_path / "summary.json")
