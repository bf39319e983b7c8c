"""The GPU path for real: skipped, with the reason, where no CUDA device is visible.

On a GPU host: real torchrun jobs on CUDA with NCCL, one process per GPU, on the tiny
generated days: fp32 and bf16 with fused tables in GPU memory, tables in host memory behind
a GPU cache (`fused_uvm_caching`), TorchRec's sparse-dist pipeline against plain steps, and
none of the CPU-only speed work applied. These need neither Prefect nor MLflow
(`bench/gpu_check.py` runs them on a host with only the bundle); the last test runs
`dlrm run` and `dlrm train` where Prefect is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from evaluation.config import EvaluationConfig
from evaluation.metrics import summarize
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.device import DeviceError
from training.launch.launcher import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host"),
]
ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count()
FUSED = ShardingConfig("table_wise", "fused")


def _job(features, out: Path, sharding: ShardingConfig = FUSED, **training) -> TrainJob:
    state, files = features
    return TrainJob(
        model=ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)),
        sharding=sharding,
        training=TrainingConfig(**{"nproc": GPUS, "batch_size": 256, "embedding_lr": 0.1, "dense_lr": 0.05,
                                   "dense_optimizer": "adagrad", "log_every": 5, "device": "cuda", "precision": "fp32",
                                   **training}),
        evaluation=EvaluationConfig(batch_size=1024, ne_window=2048),
        table_sizes=state.table_sizes,
        train_files=tuple(files[0] + files[1]),
        eval_files={"2": tuple(files[2])},
        out_dir=str(out),
    )


def _ne(job: TrainJob) -> float:
    scores = job.folder.read_predictions("2")
    assert len(scores.labels) == 6000, "every eval row scored once"
    return summarize(scores.labels, scores.predictions)["ne"]


@pytest.fixture(scope="module")
def fp32(tiny_features, tmp_path_factory: pytest.TempPathFactory) -> TrainJob:
    """The default GPU job (fused tables in GPU memory, fp32, the sparse-dist pipeline), once."""
    job = _job(tiny_features, tmp_path_factory.mktemp("gpu-fp32"))
    launch(job, on_line=lambda line: None)
    return job


def test_trains_on_cuda_with_nccl_one_process_per_gpu_and_the_sparse_pipeline(fp32: TrainJob) -> None:
    summary = fp32.folder.read_summary()
    assert (summary.device, summary.backend, summary.pipeline) == ("cuda", "nccl", "sparse_dist")
    assert summary.world_size == GPUS and summary.precision == "fp32"
    assert summary.cpu == {}, "no CPU kernel swapped into a GPU job"
    assert _ne(fp32) < 0.93


@pytest.mark.parametrize(("name", "changes"), [
    ("bf16", {"precision": "bf16"}),
    ("uvm_caching", {"sharding": ShardingConfig("table_wise", "fused_uvm_caching")}),
    ("plain_steps", {"pipeline": "plain"}),
])  # fmt: skip
def test_variants_train_like_the_fp32_pipeline(tiny_features, fp32: TrainJob, tmp_path: Path, name: str,
                                               changes: dict) -> None:  # fmt: skip
    """The host-memory tables and plain steps compute the same sums in another order: within
    0.01 NE of the fp32 pipeline. bf16 rounds the MLPs' products: at most 2 % worse (as on CPU,
    test_sharded_training)."""
    job = _job(tiny_features, tmp_path / name, **changes)
    launch(job, on_line=lambda line: None)
    summary = job.folder.read_summary()
    if name == "plain_steps":
        assert summary.pipeline == "plain"
    if name == "bf16":
        assert summary.precision == "bf16"
    if name == "uvm_caching":
        assert "fused_uvm_caching" in job.folder.plan_files[0].read_text()
    if name == "bf16":
        assert (_ne(job) - _ne(fp32)) / _ne(fp32) < 0.02, (_ne(job), _ne(fp32))
    else:
        assert abs(_ne(job) - _ne(fp32)) < 0.01, (name, _ne(job), _ne(fp32))


def test_auto_precision_takes_bf16_on_this_gpu(tiny_features, tmp_path: Path) -> None:
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    job = _job(tiny_features, tmp_path, precision="auto")
    job = replace(job, training=replace(job.training, epochs=1))
    launch(job, on_line=lambda line: None)
    assert job.folder.read_summary().precision == "bf16"


def test_more_processes_than_gpus_are_refused_before_anything_starts(tiny_features, tmp_path: Path) -> None:
    job = _job(tiny_features, tmp_path, nproc=GPUS + 1)
    with pytest.raises(DeviceError, match=rf"training.nproc = {GPUS + 1} but this host has {GPUS} GPU"):
        launch(job, on_line=lambda line: None)
    assert not job.folder.logs().exists(), "no torchrun started"


def test_dlrm_run_and_train_on_cuda(tmp_path: Path) -> None:
    pytest.importorskip("prefect", reason="the dlrm command needs Prefect and MLflow (not in the GPU bundle)")
    dlrm = [sys.executable, "-m", "flows.cli"]
    config = str(ROOT / "configs" / "tiny.toml")
    nproc = f"training.nproc={GPUS}"
    prepared = subprocess.run([*dlrm, "run", "--config", config, "--set", f'run_dir="{tmp_path}"', "--set", nproc,
                               "--json"], capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    result = subprocess.run([*dlrm, "train", "--config", config, "--set", f'run_dir="{tmp_path}"', "--set", nproc,
                             "--set", 'training.device="cuda"', "--out", str(tmp_path / "gpu"), "--json"],
                            capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cuda" and report["world_size"] == GPUS and report["eval_ne"] < 0.95
