"""One process per GPU: NCCL cannot put two ranks on one device."""

import pytest
import torch

from training.launch import device
from training.launch.device import DeviceError, check_one_process_per_gpu, runtime_device


@pytest.fixture
def one_gpu_mocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that reports one CUDA device (mocked: this machine has none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)


def test_more_processes_than_gpus_are_refused_in_one_line_mocked_gpu(one_gpu_mocked: None) -> None:
    with pytest.raises(DeviceError, match=r"^training.nproc = 2 but this host has 1 GPU\(s\).*set training.nproc = 1"):
        check_one_process_per_gpu(2, "auto")
    check_one_process_per_gpu(1, "auto")
    check_one_process_per_gpu(2, "cpu")  # CPU processes need no GPU


def test_each_rank_takes_its_own_gpu_mocked_gpu(one_gpu_mocked: None) -> None:
    assert runtime_device("auto", 0) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="training.nproc = 2"):
        runtime_device("auto", 1)
    assert runtime_device("cpu", 1) == torch.device("cpu")


def test_without_a_gpu_cpu_is_used_and_cuda_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert runtime_device("auto", 3) == torch.device("cpu")
    check_one_process_per_gpu(8, "auto")
    with pytest.raises(DeviceError, match="no CUDA device"):
        device.runtime_device("cuda", 0)
