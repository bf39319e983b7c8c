"""`dlrm characterize` on this machine: a real batch-size sweep of the tiny model (real
torchrun jobs), its saturation point, the points' figures, and the MLflow run that shows them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlflow
import pytest
import warm_commands
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from flows.run.feature_files import prepared_features
from flows.run.rows import training_rows

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
POINT_KEYS = {"batch_size", "samples_per_s", "peak_memory_mb", "measured_step_ms", "estimated_step_ms"}
PARTS = {"data", "embedding", "dense", "communication", "optimizer", "other"}


def dlrm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*warm_commands.dlrm(), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    run_dir = tmp_path_factory.mktemp("characterize")
    done = dlrm("characterize", "--config", "configs/tiny.toml", "--set", f'run_dir="{run_dir}"',
                "--sweep", "sharding.compute_kernel=fused,fused_uvm_caching", "--max-batch", "2048", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), run_dir, done.stderr


def test_the_batch_sweep_finds_a_saturation_point_and_stops(sweep) -> None:
    report, _, _ = sweep
    fused = [p for p in report["points"] if p["sharding.compute_kernel"] == "fused"]
    batches = [p["batch_size"] for p in fused]
    assert batches == [512, 1024, 2048]  # doublings from 256 a process up to --max-batch (too few to stop before)
    rates = [p["samples_per_s"] for p in fused]

    def flat_after(i: int) -> bool:  # the next two doublings each gained < 5 % over point i
        return len(rates) >= i + 3 and all(rate < rates[i] * 1.05 for rate in rates[i + 1 : i + 3])

    flat = [i for i in range(len(rates)) if flat_after(i)]
    # it stopped two points past the first point the curve was flat after, or at --max-batch
    assert (flat and flat[0] == len(rates) - 3) or (not flat and batches[-1] == 2048)
    # the hardware batch: the smallest whose throughput the best beats by < 5 %
    best = max(rates)
    assert report["hardware_batch_size"] == next(b for b, r in zip(batches, rates, strict=True) if best < r * 1.05)
    assert report["saturated"] == bool(flat or rates.index(best) < len(rates) - 1)
    for point in fused:
        assert POINT_KEYS <= set(point) and point["training.batch_size"] == point["batch_size"]
        assert point["samples_per_s_min"] <= point["samples_per_s"] <= point["samples_per_s_max"]
        assert point["measured_step_ms"] == pytest.approx(point["batch_size"] / point["samples_per_s"] * 1000, rel=1e-3)
        assert point["estimated_step_ms"] > 0 and point["peak_memory_mb"] > 100
        assert len(point["peak_memory_mb_per_rank"]) == 2  # tiny trains on 2 processes
        assert set(point["breakdown_ms"]) == PARTS and point["breakdown_ms"]["dense"] > 0
        assert point["breakdown_ms"]["communication"] > 0  # two processes exchange pooled embeddings
    key = report["tuning_key"]
    assert key["global_batch_size"] == report["hardware_batch_size"] and key["device_type"] == "cpu"


def test_a_placement_the_device_lacks_is_skipped_with_one_clear_line(sweep) -> None:
    report, _, log = sweep
    assert not [p for p in report["points"] if p["sharding.compute_kernel"] == "fused_uvm_caching"]
    (skipped,) = report["skipped"]
    assert skipped["sharding.compute_kernel"] == "fused_uvm_caching" and "needs CUDA" in skipped["reason"]
    assert "\n" not in skipped["reason"]
    assert f"batch 512: skipped: {skipped['reason']}" in log


def test_the_plots_and_the_table_are_in_mlflow(sweep) -> None:
    report, run_dir, _ = sweep
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(report["mlflow_run_id"])
    assert run.data.tags["dlrm.kind"] == "characterize"
    assert run.data.tags["characterize.hardware_batch_size"] == str(report["hardware_batch_size"])
    assert run.data.tags["tuning.key"] == report["tuning_key"]["fingerprint"]
    names = {a.path for a in client.list_artifacts(run.info.run_id, "characterize")}
    assert {"characterize/throughput_vs_batch.png", "characterize/step_breakdown.png",
            "characterize/planner_vs_measured.png", "characterize/points.json",
            "characterize/points.csv"} <= names  # fmt: skip
    points = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="characterize/points.json",
                                                 tracking_uri=client.tracking_uri)  # fmt: skip
    table = json.loads(Path(points).read_text())
    columns = table["columns"]
    rows = [dict(zip(columns, row, strict=True)) for row in table["data"]]
    # the planner-vs-measured table: a row per measured point, both figures in each
    assert [r["batch_size"] for r in rows] == [p["batch_size"] for p in report["points"]]
    assert all(r["estimated_step_ms"] > 0 and r["measured_step_ms"] > 0 for r in rows)
    history = client.get_metric_history(run.info.run_id, "samples_per_s.series_0")
    assert sorted(m.step for m in history) == [p["batch_size"] for p in report["points"]]


def test_a_malformed_sweep_is_one_line_with_exit_2(tmp_path: Path) -> None:
    done = dlrm("characterize", "--config", "configs/tiny.toml", "--set", f'run_dir="{tmp_path}"',
                "--sweep", "sharding.compute_kernel")  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        ("dlrm: error: --sweep 'sharding.compute_kernel': expected KEY=V1,V2,… "
         "(e.g. --sweep sharding.compute_kernel=fused,fused_uvm_caching)")
    ]
    bad_value = dlrm("characterize", "--config", "configs/tiny.toml", "--set", f'run_dir="{tmp_path}"',
                     "--sweep", "sharding.compute_kernel=fused,bogus")  # fmt: skip
    assert bad_value.returncode == 2 and "Traceback" not in bad_value.stderr
    assert "sharding.compute_kernel" in bad_value.stderr and len(bad_value.stderr.strip().splitlines()) == 1


def test_the_characterize_flow_publishes_the_points_as_prefect_artifacts(prefect_server, tmp_path: Path) -> None:
    """What the served `characterize/characterize` deployment runs, on one named batch."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.deployments.characterize import characterize_flow

    report = characterize_flow(str(ROOT / "configs" / "tiny.toml"), [f'run_dir="{tmp_path}"'],
                               sweeps=["training.batch_size=512"])  # fmt: skip
    assert [p["batch_size"] for p in report["points"]] == [512] and report["hardware_batch_size"] == 512

    async def artifacts(key: str):
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    (table,) = asyncio.run(artifacts("characterization"))
    assert table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [row["batch_size"] for row in rows] == [512] and rows[0]["samples_per_s"] == report["points"][0]["samples_per_s"]
    (summary,) = asyncio.run(artifacts("characterization-summary"))
    assert "hardware batch: 512" in summary.data and report["mlflow_run_id"] in summary.data


def test_own_features_characterize_the_model_the_config_trains(tmp_path: Path) -> None:
    from ingestion.preprocess import PreprocessState
    from training.job import TrainJob

    run_dir = f'run_dir="{tmp_path}"'
    args = ["characterize", "--config", "configs/tiny.toml", "--set", run_dir, "--own-features",
            "--sweep", "training.batch_size=512", "--no-tracking", "--json"]  # fmt: skip
    before = dlrm(*args)  # nothing preprocessed yet: one line saying what to run
    assert before.returncode == 2 and "Traceback" not in before.stderr
    assert "run `dlrm preprocess --config …` (or `dlrm run`)" in before.stderr.strip().splitlines()[-1]
    assert dlrm("generate", "--config", "configs/tiny.toml", "--set", run_dir).returncode == 0
    raw = sorted(str(p) for p in (tmp_path / "raw").glob("day_*.tsv.gz"))
    assert dlrm("ingest", *raw, "--warehouse", str(tmp_path / "warehouse")).returncode == 0
    assert dlrm("preprocess", "--config", "configs/tiny.toml", "--set", run_dir).returncode == 0
    done = dlrm(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [p["batch_size"] for p in report["points"]] == [512]
    job = TrainJob.load(Path(report["out_dir"]) / "as_configured" / "batch-512" / "job.json")
    (state_file,) = (tmp_path / "features").glob("*/state.json")
    state = PreprocessState.load(state_file)
    assert job.table_sizes == state.table_sizes and job.dense_features == len(state.dense)
    config = load_config(ROOT / "configs" / "tiny.toml", [run_dir])
    own = training_rows(config, prepared_features(config)).train_files  # the rows `dlrm run` would train
    assert own and all(str(state_file.parent) in f for f in own), "the training days' own features"
    assert sorted(job.train_files) == sorted(own)  # not generated rows, and not the calibrator's
