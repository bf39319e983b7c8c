"""The GPU path for real: skipped, with the reason, where no CUDA device is visible.

On a GPU host: real torchrun jobs on CUDA with NCCL, one process per GPU, on the tiny
generated days: fp32 and bf16 with fused tables in GPU memory, tables in host memory behind
a GPU cache (`fused_uvm_caching`), TorchRec's sparse-dist pipeline against plain steps, and
none of the CPU-only speed work applied, managed-collision ids with tables in GPU memory and
behind a GPU cache. These need neither Prefect nor MLflow
(`bench/gpu_check.py` runs them on a host with only the bundle); the last test runs
`dlrm run` and `dlrm train` where Prefect is installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from evaluation.config import EvaluationConfig
from evaluation.metrics import summarize
from ingestion.config import ManagedIdsConfig
from ingestion.preprocess import apply_state, fit_state
from tests.conftest import TINY_DAYS, TINY_PREPROCESS
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch.device import DeviceError
from training.launch.launcher import TrainingFailed, launch
from training.model.managed_ids import POLICIES, ManagedIds
from training.model.objective import managed_ids_of
from training.model.precision import allow_tf32
from training.serving.scoring import score_files

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.torchrun,  # on the GPU, the launch a deployment makes
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
    pipeline = "sparse_dist" if GPUS > 1 else "plain"  # one GPU: nothing to overlap (training/loop/steps.py)
    assert (summary.device, summary.backend, summary.pipeline) == ("cuda", "nccl", pipeline)
    assert summary.world_size == GPUS and summary.precision == "fp32"
    assert summary.cpu == {}, "no CPU kernel swapped into a GPU job"
    assert _ne(fp32) < 0.93


@pytest.mark.parametrize(("name", "changes"), [
    ("bf16", {"precision": "bf16"}),
    ("uvm_caching", {"sharding": ShardingConfig("table_wise", "fused_uvm_caching")}),
    ("plain_steps", {"pipeline": "plain"}),
    ("sparse_dist", {"pipeline": "sparse_dist"}),
])  # fmt: skip
def test_variants_train_like_the_fp32_pipeline(tiny_features, fp32: TrainJob, tmp_path: Path, name: str,
                                               changes: dict) -> None:  # fmt: skip
    """The host-memory tables and plain steps compute the same sums in another order: within
    0.01 NE of the fp32 pipeline. bf16 rounds the MLPs' products: at most 2 % worse (as on CPU,
    test_sharded_training)."""
    job = _job(tiny_features, tmp_path / name, **changes)
    launch(job, on_line=lambda line: None)
    summary = job.folder.read_summary()
    if name in ("plain_steps", "sparse_dist"):
        assert summary.pipeline == changes["pipeline"]
    if name == "bf16":
        assert summary.precision == "bf16"
    if name == "uvm_caching":
        assert "fused_uvm_caching" in job.folder.plan_files[0].read_text()
    if name == "bf16":
        assert (_ne(job) - _ne(fp32)) / _ne(fp32) < 0.02, (_ne(job), _ne(fp32))
    else:
        assert abs(_ne(job) - _ne(fp32)) < 0.01, (name, _ne(job), _ne(fp32))


def _one_gpu_job(features, out: Path, **training) -> TrainJob:
    """One process (the CUDA graphs' case), checkpoints every 10 steps, two epochs."""
    settings = {"nproc": 1, "checkpoint_every": 10, "epochs": 2, "dense_optimizer": "adam", "lr_decay": "cosine"}
    return _job(features, out, **{**settings, **training})


def _kill_the_worker_after(job: TrainJob, step: int) -> threading.Thread:
    """SIGKILL the job's one worker once it has logged `step`."""

    def watch() -> None:
        deadline = time.time() + 180
        while time.time() < deadline:
            metrics = job.folder.metrics
            steps = [json.loads(line)["step"] for line in (metrics.read_text().splitlines(keepends=True)
                                                           if metrics.is_file() else []) if line.endswith("\n")]  # fmt: skip
            if steps and max(steps) >= step:
                pid = job.folder.read_pid(0)  # the worker wrote it at its start
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def graphed(tiny_features, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainJob, list[str]]:
    """A one-process GPU job with its dense part as CUDA graphs (the default), never stopped."""
    job = _one_gpu_job(tiny_features, tmp_path_factory.mktemp("gpu-graphed"))
    lines: list[str] = []
    launch(job, on_line=lines.append)
    return job, lines


def test_one_gpu_replays_its_dense_part_as_cuda_graphs_and_trains_as_launching_it(tiny_features, graphed,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    """The graphs run the same kernels as the eager launches, on the same batches: the same NE
    to rounding."""
    job, lines = graphed
    assert any("the dense part replays as CUDA graphs at batch 256" in line for line in lines), lines[-20:]
    eager = _one_gpu_job(tiny_features, tmp_path / "eager", cuda_graphs="off")
    eager_lines: list[str] = []
    launch(eager, on_line=eager_lines.append)
    assert not any("CUDA graphs" in line for line in eager_lines)
    assert abs(_ne(job) - _ne(eager)) < 2e-3, (_ne(job), _ne(eager))


def test_a_killed_graphed_run_resumes_to_the_same_parameters(tiny_features, graphed, tmp_path: Path) -> None:
    """Exact resume with the graphs: a run killed after step 25 and launched again ends with the
    uninterrupted run's parameters (its scores of the evaluation day), every row trained once
    per epoch."""
    reference, _ = graphed
    job = _one_gpu_job(tiny_features, tmp_path / "killed")
    watcher = _kill_the_worker_after(job, step=25)
    with pytest.raises(TrainingFailed):
        launch(job, on_line=lambda line: None)
    watcher.join()
    lines: list[str] = []
    launch(job, on_line=lines.append)
    assert any("resuming from" in line for line in lines)
    resumed, expected = job.folder.read_summary(), reference.folder.read_summary()
    assert resumed.steps == expected.steps and resumed.rows_trained == expected.rows_trained
    assert resumed.rows_fingerprint == expected.rows_fingerprint
    # the final model's scores of the evaluation day: the same parameters score the same
    scores, reference_scores = job.folder.read_predictions("2"), reference.folder.read_predictions("2")
    assert np.array_equal(scores.labels, reference_scores.labels)
    assert np.abs(scores.predictions - reference_scores.predictions).max() < 1e-6


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


@pytest.mark.parametrize("policy", POLICIES)
def test_managed_ids_admit_evict_and_remap_on_cuda_as_on_cpu(policy: str) -> None:
    """The same rounds on the same ids give the same rows on both devices (the remapper sits
    on the device the process trains on)."""
    sizes = {"C1": 50, "C2": 9}
    on = {device: ManagedIds(sizes, policy, 2, torch.device(device)) for device in ("cpu", "cuda")}
    generator = torch.Generator().manual_seed(3)
    for round_ in range(6):
        ids = {f: (torch.randint(0, 40 + 30 * round_, (400,), generator=generator) ** 2 // 97) for f in sizes}
        changed = {device: managed.admit({f: v.to(device) for f, v in ids.items()}) for device, managed in on.items()}
        for feature in sizes:
            assert sorted(changed["cpu"][feature].tolist()) == sorted(changed["cuda"][feature].cpu().tolist())
            assert on["cpu"].id_rows(feature) == on["cuda"].id_rows(feature)
        query = torch.cat([ids["C1"][:64], torch.arange(10**6, 10**6 + 8), ids["C2"][:72]])
        kjt = KeyedJaggedTensor.from_lengths_sync(["C1", "C2"], query, torch.ones(144, dtype=torch.int64))
        cpu_rows = on["cpu"].remap(kjt).values()
        assert torch.equal(cpu_rows, on["cuda"].remap(kjt.to(torch.device("cuda"))).values().cpu())
        assert (cpu_rows[64:72] == sizes["C1"] - 1).all(), "never-seen ids share the miss row"


@pytest.fixture(scope="module")
def managed_features(tiny_warehouse: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny days with raw ids for managed tables of at most 200 rows: fewer rows than the
    larger features' ids, so rounds evict."""
    config = replace(TINY_PREPROCESS, hash_size=200, categorical_mode="managed")
    root = tmp_path_factory.mktemp("managed-features")
    state = fit_state(config, tiny_warehouse, root, (0, 1))
    return state, {day: [str(p) for p in sorted(apply_state(config, state, tiny_warehouse, root, day).glob("*.parquet"))]
                   for day in TINY_DAYS}  # fmt: skip


def _rescored_on_the_gpu(job: TrainJob) -> np.ndarray:
    """Day 2 scored from the final checkpoint (weights and remapping) by an unsharded model
    on the GPU, in the run's row order, with the run's TF32 products."""
    pytest.importorskip("mlflow", reason="loading a checkpoint for export needs MLflow (not in the GPU bundle)")
    from training.serving.export import _load_trained

    cuda = torch.device("cuda")
    allow_tf32(cuda)
    trained = _load_trained(job, Path(job.folder.read_summary().checkpoint)).to(cuda).eval()
    managed = managed_ids_of(trained)
    assert managed is not None

    def logits_of(dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return trained.model(dense.to(cuda), managed.remap(sparse.to(cuda))).squeeze(-1).cpu()

    # the run's batch: TF32 products of another shape may take other kernels (3e-4 apart, measured)
    return score_files(logits_of, job.eval_files["2"], "C1", job.evaluation.batch_size).predictions


@pytest.mark.parametrize(("sharding_type", "kernel"), [("table_wise", "fused"), ("row_wise", "fused"),
                                                      ("table_wise", "fused_uvm_caching")])  # fmt: skip
def test_managed_ids_train_on_cuda_and_the_checkpoint_scores_as_the_run_did(managed_features, tmp_path: Path,
                                                                            sharding_type: str, kernel: str) -> None:  # fmt: skip
    """Rounds admit and evict on the GPU, restarting rows in GPU memory or, behind a GPU cache,
    in host memory; the final checkpoint then scores day 2 as the run's own evaluation did.
    A restarted row the cache kept (or wrote back over the restart) would differ: the last
    round restarts rows just before the run's evaluation and its checkpoint."""
    job = replace(_job(managed_features, tmp_path, ShardingConfig(sharding_type, kernel), pipeline="auto"),
                  managed_ids=ManagedIdsConfig("lru", eviction_interval=5))  # fmt: skip
    launch(job, on_line=lambda line: None)
    summary = job.folder.read_summary()
    assert (summary.device, summary.pipeline) == ("cuda", "plain"), "managed ids take plain steps"
    plan = job.folder.plan_files[0].read_text()
    assert kernel in plan and sharding_type in plan
    assert summary.managed_rounds >= 5 and summary.managed_restarted_rows > 0
    run = job.folder.read_predictions("2").predictions
    rescored = _rescored_on_the_gpu(job)
    assert rescored.shape == run.shape == (6000,)
    assert np.abs(rescored - run).max() <= 1e-6, (sharding_type, kernel, float(np.abs(rescored - run).max()))
    assert _ne(job) < 0.97
