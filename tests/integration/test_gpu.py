"""The GPU path for real: skipped, with the reason, where no CUDA device is visible.

On a GPU host: `dlrm train` on CUDA with NCCL and TorchRec's TrainPipelineSparseDist, and
none of the CPU-only speed work (native kernels, oneDNN layers, malloc settings) applied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.job import JobFolder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host"),
]
ROOT = Path(__file__).resolve().parents[2]
DLRM = str(Path(sys.executable).parent / "dlrm")


def test_dlrm_trains_on_cuda_with_nccl_and_the_sparse_pipeline(tmp_path: Path) -> None:
    config = str(ROOT / "configs" / "tiny.toml")
    prepared = subprocess.run([DLRM, "run", "--config", config, "--set", f'run_dir="{tmp_path}"', "--json"],
                              capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    nproc = min(2, torch.cuda.device_count())
    result = subprocess.run([DLRM, "train", "--config", config, "--set", f'run_dir="{tmp_path}"',
                             "--set", f"training.nproc={nproc}", "--set", 'training.device="cuda"',
                             "--out", str(tmp_path / "gpu"), "--json"],
                            capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cuda" and report["world_size"] == nproc and report["eval_ne"] < 0.95
    summary = JobFolder(tmp_path / "gpu").read_summary()
    assert (summary.backend, summary.pipeline) == ("nccl", "sparse_dist")
    assert summary.cpu == {}, "no CPU kernel on a GPU host"
