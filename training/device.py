"""Runtime choice of device and collective backend: CUDA + NCCL when present, else CPU + gloo."""

from __future__ import annotations

import torch


class DeviceError(RuntimeError):
    """The configured device is not available on this host."""


def runtime_device(preference: str, local_rank: int) -> torch.device:
    """The device this process trains on. `auto` takes CUDA whenever it is visible."""
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if preference == "cuda":
        raise DeviceError("training.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
