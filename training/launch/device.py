"""Runtime choice of device and collective backend: CUDA + NCCL when present, else CPU + gloo."""

from __future__ import annotations

import os

import torch


class DeviceError(RuntimeError):
    """The configured device is not available on this host."""


def runtime_device(preference: str, local_rank: int) -> torch.device:
    """The device this process trains on. `auto` takes CUDA whenever it is visible."""
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        # one GPU per process: NCCL refuses two ranks on one device ("Duplicate GPU detected")
        if local_rank >= torch.cuda.device_count():
            raise DeviceError(too_many_processes(local_rank + 1, torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if preference == "cuda":
        raise DeviceError("training.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device("cpu")


def check_one_process_per_gpu(nproc: int, preference: str) -> None:
    """Refuse, before anything starts, more processes on this host than it has GPUs."""
    if preference != "cpu" and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise DeviceError(too_many_processes(nproc, torch.cuda.device_count()))


def too_many_processes(nproc: int, gpus: int) -> str:
    return (f"training.nproc = {nproc} but this host has {gpus} GPU(s), and each process needs a GPU "
            f"of its own: set training.nproc = {gpus} (or training.device = 'cpu')")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_bytes(device: torch.device) -> int:
    """A GPU's own memory (HBM); for the CPU, the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()
