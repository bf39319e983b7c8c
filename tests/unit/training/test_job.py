"""A training job's records and folder: the job as JSON, the summary written and read as
one typed record (checked on load), each part's predictions, the plan, the hosts' marks."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from evaluation.config import EvaluationConfig
from training.codec import SchemaError
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import JobFolder, TrainJob, TrainSummary

SUMMARY = TrainSummary(
    steps=46, samples=11_520, seconds=0.5, samples_per_s=23_040.0, first_step_seconds=0.2, compiled=False,
    precision="fp32", cpu={"interaction": "native", "malloc": "retain"}, rows_trained=11_776,
    rows_fingerprint=2**64 - 5, resumed_from_step=0, world_size=2, global_batch_size=256, device="cpu",
    backend="gloo", pipeline="plain", checkpoint="/runs/train/checkpoints/default/step-46", eval_rows_rank0=3000,
)  # fmt: skip


def _write(folder: JobFolder, **changes) -> JobFolder:
    folder.root.mkdir(parents=True, exist_ok=True)
    data = {**asdict(SUMMARY), **changes}
    folder.summary_file.write_text(json.dumps({k: v for k, v in data.items() if v is not ...}))
    return folder


def test_the_job_round_trips_through_its_json_file(tmp_path: Path) -> None:
    job = TrainJob(ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(8, 1)), ShardingConfig(),
                   TrainingConfig(nproc=2, batch_size=512, torchrun_args=("--monitor-interval=1",)),
                   EvaluationConfig(), {"C1": 7}, ("a.parquet",), {"2026-11-24": ("b.parquet",), "holdout": ()},
                   str(tmp_path), run_id="r", hosts=2, pooling_factors={"C1": 2.5})  # fmt: skip
    job.save(job.folder.job_file())
    loaded = TrainJob.load(job.folder.job_file())
    assert loaded == job and loaded.training.torchrun_args == ("--monitor-interval=1",), "lists back to tuples"
    assert loaded.workers.world_size == 4 and loaded.workers.per_rank_batch(512) == 128
    assert loaded.checkpoint_root == tmp_path / "checkpoints" / "r"


def test_a_saved_summary_loads_equal(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    folder.write_summary(SUMMARY)
    assert folder.read_summary() == SUMMARY
    on_gpu = replace(SUMMARY, cpu={}, device="cuda", backend="nccl")
    folder.write_summary(on_gpu)
    assert folder.read_summary() == on_gpu
    assert not list(tmp_path.glob("*.staged")), "written whole, then renamed"


def test_the_json_keeps_the_names_other_tools_read(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    folder.write_summary(SUMMARY)
    data = json.loads(folder.summary_file.read_text())
    for key in ("steps", "samples_per_s", "rows_trained", "resumed_from_step", "world_size", "global_batch_size",
                "device", "precision"):  # fmt: skip
        assert data[key] == getattr(SUMMARY, key)


def test_a_missing_field_is_named(tmp_path: Path) -> None:
    folder = _write(JobFolder(tmp_path), rows_trained=..., world_size=...)
    with pytest.raises(SchemaError, match=r"summary.json: TrainSummary is missing field\(s\) rows_trained, world_size"):
        folder.read_summary()


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("steps", "46", "summary.json: steps: expected int, got str '46'"),
        ("steps", 46.0, "summary.json: steps: expected int, got float 46.0"),
        ("world_size", True, "summary.json: world_size: expected int, got bool True"),
        ("compiled", 0, "summary.json: compiled: expected bool, got int 0"),
        ("samples_per_s", None, "summary.json: samples_per_s: expected float, got NoneType None"),
        ("cpu", ["native"], "summary.json: cpu: expected a table, got list"),
        ("cpu", {"interaction": 1}, "summary.json: cpu.interaction: expected str, got int 1"),
    ],
)
def test_a_mistyped_field_is_named_with_its_value(tmp_path: Path, field: str, value, expected: str) -> None:
    with pytest.raises(SchemaError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        _write(JobFolder(tmp_path), **{field: value}).read_summary()


def test_whole_numbers_are_accepted_as_floats_and_unknown_keys_ignored(tmp_path: Path) -> None:
    loaded = _write(JobFolder(tmp_path), seconds=2, added_later="x").read_summary()
    assert loaded.seconds == 2.0 and isinstance(loaded.seconds, float)


def test_a_file_that_is_not_json_says_so(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    folder.summary_file.write_text('{"steps": 4')
    with pytest.raises(SchemaError, match="summary.json: not JSON"):
        folder.read_summary()


def test_each_parts_predictions_come_back_in_rank_order(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    rng = np.random.default_rng(0)
    written = {}
    for part in ("2026-11-24", "holdout"):
        for rank in (1, 0):  # written in any order
            labels, predictions, slices = rng.integers(0, 2, 5), rng.random(5).astype(np.float32), rng.integers(0, 9, 5)
            assert folder.write_predictions(part, rank, labels, predictions, slices) == 5
            written[part, rank] = predictions
    day = folder.read_predictions("2026-11-24")
    np.testing.assert_array_equal(day.predictions, np.concatenate([written["2026-11-24", 0], written["2026-11-24", 1]]))
    assert len(folder.read_predictions().labels) == 20, "every part"
    assert folder.predictions("holdout").name == "day=holdout"


def test_the_plan_is_read_back_and_a_job_without_one_has_none(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    assert folder.read_plan() == []
    rows = [{"table": "t_C1", "sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [0],
             "bytes_per_rank": {"0": 128}}]  # fmt: skip
    folder.write_plan("table  sharding", rows)
    assert folder.read_plan() == rows and folder.plan_files[0].read_text() == "table  sharding\n"


def test_a_hosts_failure_is_seen_by_the_others_until_it_launches_again(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    assert folder.peer_failure(0, nnodes=2) is None
    folder.record_failure(1, "rank 1 was killed by SIGKILL")
    assert folder.peer_failure(0, nnodes=2) == "node 1: rank 1 was killed by SIGKILL"
    assert folder.peer_failure(1, nnodes=2) is None, "a host does not stop for its own mark"
    folder.clear_failure(1)
    assert folder.peer_failure(0, nnodes=2) is None


def test_a_launch_clears_what_it_rewrites_and_keeps_checkpoints(tmp_path: Path) -> None:
    folder = JobFolder(tmp_path)
    for path in (folder.metrics, folder.summary_file, folder.predictions("2") / "rank-00000.parquet",
                 folder.logs(1) / "x.log", folder.checkpoints("r") / "step-5" / "meta.json"):  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    folder.write_pid(rank=1, pid=4321)
    folder.write_pid(rank=10, pid=99)
    assert folder.rank_pids() == {1: 4321, 10: 99}
    folder.clear_for_launch(node_rank=1, leads=False, fresh=True)
    assert folder.summary_file.exists() and not folder.logs(1).exists(), "another host clears only its own logs"
    assert folder.read_pid(1) == 4321
    folder.clear_for_launch(node_rank=None, leads=True, fresh=False)
    assert not folder.summary_file.exists() and not (tmp_path / "predictions").exists()
    assert folder.read_pid(1) is None, "the leading host clears the ranks' process ids: its launch writes them anew"
    assert folder.rank_pids() == {}
    assert folder.metrics.exists(), "a resumed run keeps the metrics of the steps its checkpoint holds"
    folder.clear_for_launch(node_rank=None, leads=True, fresh=True)
    assert not folder.metrics.exists() and (folder.checkpoints("r") / "step-5" / "meta.json").exists()
