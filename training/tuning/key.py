"""The tuning key: a fingerprint of everything that invalidates tuned hyperparameters.

Hyperparameters tuned at one global batch size, world size and kind of hardware lose NE
elsewhere (learning rates, warm-up and decay interact with the batch size and with how
many workers average their gradients). A run whose key was never tuned needs retuning.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from training.config import ClusterConfig, TrainingConfig, Workers
from training.launch.device import host_memory_bytes


@dataclass(frozen=True)
class TuningKey:
    global_batch_size: int
    world_size: int
    hosts: int
    device_type: str  # "cuda" | "cpu"
    device_model: str  # e.g. "NVIDIA H100 80GB HBM3" or the CPU's model name
    memory_per_device_gb: int  # rounded: a few MB of difference between hosts is not new hardware

    @property
    def fingerprint(self) -> str:
        """12 hex characters, stable across processes and hosts."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def as_tags(self) -> dict[str, str]:
        """MLflow tags (`tuning.key` plus one per field)."""
        return {"tuning.key": self.fingerprint, **{f"tuning.key.{k}": str(v) for k, v in asdict(self).items()}}

    def hardware(self) -> tuple[str, str, int]:
        return self.device_type, self.device_model, self.memory_per_device_gb

    def distance(self, other: TuningKey) -> float:
        """How far another key's hyperparameters are from fitting this one (for "nearest").

        Batch size and world size count by their log ratio; other hardware counts more
        than any plausible batch change, so a same-hardware key is always preferred.
        """
        return (
            abs(math.log2(self.global_batch_size / other.global_batch_size))
            + abs(math.log2(self.world_size / other.world_size))
            + (0 if self.hosts == other.hosts else 1)
            + (0 if self.hardware() == other.hardware() else 16)
        )


def tuning_key(config: TrainingConfig, workers: Workers, cluster: ClusterConfig | None = None) -> TuningKey:
    """The key of a run of `config` on `workers` (processes on hosts like this one, as the
    worker will choose its device). `cluster`: the trainer hosts as declared, when they are
    not like this one (a CPU-only flow host driving GPU trainers): the device type, model
    and memory come from it."""
    use_cuda = config.device != "cpu" and torch.cuda.is_available()
    if cluster is not None:
        device_type, model = cluster.compute_device, cluster.device_model or cluster.name
        memory = (cluster.device_memory_gb if device_type == "cuda"
                  else cluster.host_memory_gb / max(1, workers.nproc)) * 2**30  # fmt: skip
    elif use_cuda:
        properties = torch.cuda.get_device_properties(0)
        device_type, model, memory = "cuda", properties.name, properties.total_memory
    else:
        device_type, model = "cpu", cpu_model_name()
        memory = host_memory_bytes() // max(1, workers.nproc)  # each process's share
    return TuningKey(
        global_batch_size=config.batch_size,
        world_size=workers.world_size,
        hosts=workers.hosts,
        device_type=device_type,
        device_model=model,
        memory_per_device_gb=round(memory / 2**30),
    )


def cpu_model_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()

