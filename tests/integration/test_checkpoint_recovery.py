"""Checkpoints survive a killed worker, and load across world sizes."""

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tiny_jobs import tiny_job

from evaluation.config import EvaluationConfig
from training.codec import encode
from training.config import CpuConfig
from training.job import TrainJob
from training.launch.launcher import TrainingFailed, launch
from training.loop.checkpoint_chain import latest_checkpoint
from training.loop.progress import read_records
from training.serving.export import export_model

pytestmark = pytest.mark.slow


def _job(features, out: Path, cpu: CpuConfig | None = None, **training) -> TrainJob:
    training["cpu"] = cpu or CpuConfig()
    settings = {"nproc": 2, "batch_size": 256, "embedding_lr": 0.1, "dense_lr": 0.05, "dense_optimizer": "adam",
                "warmup_steps": 5, "lr_decay": "cosine", "epochs": 3, "log_every": 5, "checkpoint_every": 10}
    return tiny_job(features, out, **{**settings, **training})


HELDOUT = EvaluationConfig(batch_size=1024, ne_window=2048, heldout_every_steps=7, heldout_batches=1)


@pytest.fixture(scope="module")
def uninterrupted(tiny_features, tmp_path_factory: pytest.TempPathFactory) -> TrainJob:
    """The run every interrupted one must end equal to: plain steps, never stopped (with a
    held-out NE every 7 steps, which trains nothing)."""
    job = replace(_job(tiny_features, tmp_path_factory.mktemp("uninterrupted"), pipeline="plain"), evaluation=HELDOUT)
    launch(job, on_line=lambda line: None)
    return job


def _rows_given(job: TrainJob) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in job.train_files)


def _logged_step(metrics: str) -> int:
    """The last step in the job's metrics file; a line still being written is not counted yet."""
    steps = [0]
    for line in metrics.splitlines(keepends=True):
        if line.endswith("\n"):
            steps.append(json.loads(line)["step"])
    return max(steps)


def _kill_one_worker_after(job: TrainJob, step: int, metrics: Path | None = None) -> threading.Thread:
    """SIGKILL rank 1's process once the run has logged `step` (in `metrics`: by default the job's)."""
    def watch() -> None:
        metrics_file = metrics or job.folder.metrics
        deadline = time.time() + 120
        while time.time() < deadline:
            if metrics_file.is_file() and _logged_step(metrics_file.read_text()) >= step:
                pid = job.folder.read_pid(rank=1)  # under warm ranks or torchrun alike
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _params(job: TrainJob) -> dict[str, torch.Tensor]:
    return export_model(job, latest_checkpoint(job.checkpoint_root)).state_dict()


def test_killed_worker_resumes_to_the_same_parameters(tiny_features, uninterrupted: TrainJob, tmp_path: Path) -> None:
    reference = uninterrupted
    expected = encode(reference.folder.read_summary())

    job = _job(tiny_features, tmp_path / "killed")
    watcher = _kill_one_worker_after(job, step=25)
    with pytest.raises(TrainingFailed) as caught:
        launch(job, on_line=lambda line: None)
    watcher.join()
    assert "rank 1" in str(caught.value) and "SIGKILL" in str(caught.value)
    survived = int(latest_checkpoint(job.checkpoint_root).name.split("-")[1])
    assert 20 <= survived < expected["steps"], "killed mid-run, after some checkpoints"

    lines: list[str] = []
    launch(job, on_line=lines.append)  # the relaunch of the same run resumes
    resumed = encode(job.folder.read_summary())
    assert any("resuming from" in line for line in lines)
    assert resumed["resumed_from_step"] == survived
    assert resumed["steps"] == expected["steps"]
    # Every sample trained exactly once: same count, same multiset of rows.
    assert resumed["rows_trained"] == expected["rows_trained"] == _rows_given(job) * 3, "every row, every epoch"
    assert resumed["rows_fingerprint"] == expected["rows_fingerprint"]
    for name, value in _params(reference).items():
        assert torch.allclose(_params(job)[name], value, atol=1e-6), name


def test_a_failed_launch_is_relaunched_and_resumes(tiny_features, uninterrupted: TrainJob, tmp_path: Path) -> None:
    job = _job(tiny_features, tmp_path / "restarted", max_restarts=1)
    watcher = _kill_one_worker_after(job, step=25)
    lines: list[str] = []
    launch(job, on_line=lines.append)
    watcher.join()
    summary = encode(job.folder.read_summary())
    assert any("rank 1 was killed by SIGKILL" in line for line in lines), "the failure is reported"
    assert any("relaunching (restart 1 of 1)" in line for line in lines)
    assert summary["resumed_from_step"] >= 20 and any("resuming from" in line for line in lines)
    assert summary["rows_trained"] == _rows_given(job) * 3
    # `auto` chose the same kernels for the relaunch as for the first launch, without timing
    chosen = [line for line in lines if "CPU kernels:" in line]
    assert len(chosen) == 2 and chosen[0] == chosen[1]
    assert summary["rows_fingerprint"] == uninterrupted.folder.read_summary().rows_fingerprint
    for name, value in _params(uninterrupted).items():
        assert torch.allclose(_params(job)[name], value, atol=1e-6), name


def test_checkpoints_load_across_world_sizes(tiny_features, uninterrupted: TrainJob, tmp_path: Path) -> None:
    two = uninterrupted  # two processes
    two_params = _params(two)
    # 2 → 1: a one-process run starts from the two-process checkpoint's weights.
    one = replace(_job(tiny_features, tmp_path / "one", epochs=1, checkpoint_every=0, nproc=1, embedding_lr=1e-12,
                       dense_lr=1e-12), init_checkpoint=str(latest_checkpoint(two.checkpoint_root)))  # fmt: skip
    launch(one, on_line=lambda line: None)
    # 1 → 2: and back, into two processes again.
    back = replace(_job(tiny_features, tmp_path / "back", epochs=1, checkpoint_every=0, embedding_lr=1e-12,
                        dense_lr=1e-12), init_checkpoint=str(latest_checkpoint(one.checkpoint_root)))  # fmt: skip
    launch(back, on_line=lambda line: None)
    for params in (_params(one), _params(back)):
        for name, value in two_params.items():
            assert torch.allclose(params[name], value, atol=1e-4), name  # lr 1e-12: the weights barely move


def test_the_sparse_dist_pipeline_trains_what_plain_steps_train_and_resumes(tiny_features, uninterrupted: TrainJob,
                                                                           tmp_path: Path) -> None:  # fmt: skip
    """TorchRec's TrainPipelineSparseDist reads two batches ahead of the one it trains.
    Killed mid-run and resumed, it must still train every row once, in the plain loop's
    order, to the same parameters; held-out evaluations pause it between steps."""
    plain = uninterrupted
    expected = encode(plain.folder.read_summary())

    job = replace(_job(tiny_features, tmp_path / "pipelined", pipeline="sparse_dist"), evaluation=HELDOUT)
    watcher = _kill_one_worker_after(job, step=25)
    with pytest.raises(TrainingFailed):
        launch(job, on_line=lambda line: None)
    watcher.join()
    launch(job, on_line=lambda line: None)
    resumed = encode(job.folder.read_summary())
    assert resumed["pipeline"] == "sparse_dist" and expected["pipeline"] == "plain"
    assert resumed["resumed_from_step"] >= 20
    assert resumed["rows_trained"] == expected["rows_trained"]
    assert resumed["rows_fingerprint"] == expected["rows_fingerprint"]
    for name, value in _params(plain).items():
        assert torch.allclose(_params(job)[name], value, atol=1e-6), name
    heldout = [getattr(r, "heldout_ne", None) for r in read_records(job.folder.metrics)]
    expected_heldout = [getattr(r, "heldout_ne", None) for r in read_records(plain.folder.metrics)]
    assert heldout == pytest.approx(expected_heldout)


def test_this_projects_embedding_updates_train_what_fbgemms_kernel_trains(tiny_features, tmp_path: Path) -> None:
    """The same 2-process job with fbgemm's row-wise Adagrad kernel and with each of this project's:
    the same embeddings, to float rounding (the two sum a row's mean square in different
    orders). The MLPs are held still (lr 1e-12): with Adam on them, rounding-level
    differences grow through training to ~1e-3, which would hide a real difference."""
    runs = {}
    for kernel in ("fbgemm", "vectorized", "native"):
        job = _job(tiny_features, tmp_path / kernel, CpuConfig(embedding_update=kernel), epochs=1, dense_lr=1e-12)
        launch(job, on_line=lambda line: None)
        assert encode(job.folder.read_summary())["cpu"]["embedding_update"] == kernel
        runs[kernel] = _params(job)
    embedding_names = [name for name in runs["fbgemm"] if "embedding_bags" in name]
    assert embedding_names
    for name, value in runs["fbgemm"].items():
        for kernel in ("vectorized", "native"):
            assert torch.allclose(runs[kernel][name], value, rtol=0, atol=1e-6), (kernel, name)


def _chosen_length_job(features, out: Path) -> TrainJob:
    """A run that chooses its length on day 1 and keeps no calibrator (`calibration = "none"`),
    so the kept model then trains a pass over day 1 (training/worker.py), checkpointing as it goes."""
    _, files = features
    job = _job(features, out, epochs="auto", max_epochs=3, patience=1, warmup_steps=0, lr_decay="none",
               checkpoint_every=4, keep_checkpoints=2)  # fmt: skip
    return replace(job, train_files=tuple(files[0]), calibration_files=tuple(files[1]),
                   validation_files=tuple(files[1]), refit_files=tuple(files[0] + files[1]),
                   evaluation=replace(job.evaluation, calibration="none"))  # fmt: skip


def test_a_run_killed_in_its_pass_over_the_held_out_rows_resumes_it(tiny_features, tmp_path: Path) -> None:
    """Killed in the pass that follows the chosen epochs, the relaunch resumes the pass from its
    own checkpoint, on the kept model it reloads: the same rows, the same parameters."""
    expected_job = _chosen_length_job(tiny_features, tmp_path / "whole")
    launch(expected_job, on_line=lambda line: None)
    expected = encode(expected_job.folder.read_summary())
    assert expected["refit"] and "one more pass, over the held-out rows" in expected["run_length"]

    job = _chosen_length_job(tiny_features, tmp_path / "killed")
    last_pass = replace(job, out_dir=str(job.out / "refit"))  # where the pass logs and checkpoints
    watcher = _kill_one_worker_after(job, step=9, metrics=last_pass.folder.metrics)
    with pytest.raises(TrainingFailed):
        launch(job, on_line=lambda line: None)
    watcher.join()
    survived = latest_checkpoint(last_pass.checkpoint_root)
    assert survived is not None, "killed in the pass, after one of its checkpoints"
    lines: list[str] = []
    launch(job, on_line=lines.append)
    resumed = encode(job.folder.read_summary())
    assert any(f"resuming from {survived}" in line for line in lines), "the pass resumes from its own checkpoint"
    assert (resumed["steps"], resumed["rows_trained"]) == (expected["steps"], expected["rows_trained"])
    assert resumed["rows_fingerprint"] == expected["rows_fingerprint"]
    assert resumed["rows_trained"] == expected["epochs_kept"] * _rows_given(job) + \
        sum(pq.ParquetFile(f).metadata.num_rows for f in job.validation_files)  # fmt: skip
    served = export_model(job, Path(resumed["checkpoint"])).state_dict()
    for name, value in export_model(expected_job, Path(expected["checkpoint"])).state_dict().items():
        assert torch.allclose(served[name], value, atol=1e-6), name
