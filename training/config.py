"""Configuration of the model, its sharding and the training run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
COMPUTE_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching", "dense")


@dataclass(frozen=True)
class ModelConfig:
    """DLRM shape: `bottom_mlp` ends at `embedding_dim`, `top_mlp` ends at one logit."""

    arch: Literal["dlrm", "dlrm_dcn"] = "dlrm"
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 16)
    top_mlp: tuple[int, ...] = (512, 256, 1)
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 64

    def __post_init__(self) -> None:
        if self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim: must be positive, got {self.embedding_dim}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp: must end with embedding_dim ({self.embedding_dim}), "
                f"got {list(self.bottom_mlp)}"
            )
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: must end with 1 (the logit), got {list(self.top_mlp)}")
        if any(width <= 0 for width in (*self.bottom_mlp, *self.top_mlp)):
            raise ValueError("bottom_mlp: layer widths must be positive")


@dataclass(frozen=True)
class ShardingConfig:
    """How the planner may place embedding tables (one rule for every table)."""

    sharding_type: Literal[
        "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"
    ] = "table_wise"
    compute_kernel: Literal["fused", "fused_uvm", "fused_uvm_caching", "dense"] = "fused"

    def __post_init__(self) -> None:
        if (self.sharding_type == "data_parallel") != (self.compute_kernel == "dense"):
            raise ValueError(
                "compute_kernel: data_parallel tables use the 'dense' kernel and only they do "
                f"(got {self.sharding_type} with {self.compute_kernel})"
            )


@dataclass(frozen=True)
class TrainingConfig:
    """The torchrun job. `batch_size` is global: each of `nproc` ranks takes an equal share."""

    nproc: int = 2
    batch_size: int = 2048
    epochs: int = 1
    embedding_lr: float = 0.05
    dense_lr: float = 0.001
    dense_optimizer: Literal["adagrad", "adam"] = "adam"
    warmup_steps: int = 0
    lr_decay: Literal["none", "linear", "cosine"] = "none"
    min_lr_fraction: float = 0.0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads_per_proc: int = 1
    seed: int = 0
    log_every: int = 20
    # Sharded checkpoints every this many steps (0: only at the end); the last K are kept.
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    # A failed launch is relaunched this many times; each relaunch resumes from a checkpoint.
    max_restarts: int = 0
    # Extra torchrun arguments for multi-node runs (e.g. ["--nnodes=2", "--rdzv-endpoint=h:29400"]).
    torchrun_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc: must be at least 1, got {self.nproc}")
        if self.batch_size < self.nproc or self.batch_size % self.nproc:
            raise ValueError(
                f"batch_size: must be a positive multiple of nproc ({self.nproc}), "
                f"got {self.batch_size}"
            )
        if self.epochs < 1:
            raise ValueError(f"epochs: must be at least 1, got {self.epochs}")
        for key in ("embedding_lr", "dense_lr"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: must be positive, got {getattr(self, key)}")
        if self.threads_per_proc < 1:
            raise ValueError(f"threads_per_proc: must be at least 1, got {self.threads_per_proc}")
        if self.log_every < 1:
            raise ValueError(f"log_every: must be at least 1, got {self.log_every}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be ≥ 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_fraction <= 1.0:
            raise ValueError(f"min_lr_fraction: must be in [0, 1], got {self.min_lr_fraction}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every: must be ≥ 0, with keep_checkpoints ≥ 1")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be ≥ 0, got {self.max_restarts}")

    @property
    def batch_size_per_rank(self) -> int:
        return self.batch_size // self.nproc
