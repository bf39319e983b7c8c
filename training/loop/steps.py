"""How one training step runs: directly, or through TorchRec's `TrainPipelineSparseDist`.

The pipeline copies batch i+2 to the device and starts batch i+1's input distribution (the
all-to-all of its ids) while batch i trains, on side CUDA streams. Batches still train one
at a time and in the order they were read, so the loop can match each step to the batch it
trained: the trained-rows ledger and the checkpoint position follow trained batches, never
the ones in flight (a resume reads those again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal, Protocol

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer

from training.config import TrainingConfig
from training.loop.optimizers import dense_optimizer

StepOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # loss, logits, labels (detached)


def autocast(config: TrainingConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's precision context: bf16 autocast, or for fp32 no context at all (a
    disabled autocast still costs each step its entry and exit)."""
    if config.precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def pipeline_kind(config: TrainingConfig, device: torch.device, managed_ids: bool = False,
                  world_size: int = 1) -> Literal["sparse_dist", "plain"]:  # fmt: skip
    """`auto` pipelines on several GPUs, where copies and the ids' all-to-all run on side streams.

    On CPU nothing runs beside the step (no streams) and the pipeline's bookkeeping costs
    time, so `auto` takes plain steps there. So it does on one GPU, where there is no
    all-to-all to hide and the host is the limit: on an H200 (bench/gpu_step_probe.py, the
    dense part as CUDA graphs) plain steps took 4.2 ms at global batch 8,192, where the
    pipelined eager step took 6.9 and TorchRec's stock loop 6.6–9.6. Managed-collision ids
    take plain steps too: the pipeline starts the ids' all-to-all from the batch as read,
    before they are remapped (the config loader refuses `pipeline = "sparse_dist"` with them).
    """
    if config.pipeline == "auto":
        return "sparse_dist" if device.type == "cuda" and world_size > 1 and not managed_ids else "plain"
    return config.pipeline


class TrainSteps(Protocol):
    def step(self, batches: Iterator[Batch]) -> StepOutput:
        """Train the next batch of `batches` (forward, backward, optimizer step)."""
        ...

    def pause(self) -> nn.Module:
        """The model with its own forward, for evaluation between steps or after training."""
        ...


class PlainSteps:
    """One batch at a time: copy, forward, backward, step.

    Only the dense optimizer is zeroed and stepped: the fused embedding optimizer updates the
    tables inside the backward, and its own `zero_grad` and `step` only copy its rate into the
    kernels again (2 × 10 µs a step on this model's CPU path), which the schedule does when the
    rate changes (loop/schedule.py). A batch already on the device (a CPU host) is not moved.
    """

    def __init__(self, model: nn.Module, optimizer: CombinedOptimizer, config: TrainingConfig,
                 device: torch.device) -> None:  # fmt: skip
        self.model, self.config, self.device = model, config, device
        self.dense = dense_optimizer(model, optimizer)
        self.move = device.type != "cpu"

    def step(self, batches: Iterator[Batch]) -> StepOutput:
        batch = next(batches)
        if self.move:
            batch = batch.to(self.device, non_blocking=True)
        with autocast(self.config, self.device):
            loss, (_, logits, labels) = self.model(batch)
        self.dense.zero_grad()
        loss.backward()
        self.dense.step()
        return loss.detach(), logits, labels

    def pause(self) -> nn.Module:
        return self.model


class PipelinedSteps:
    """TorchRec's `TrainPipelineSparseDist`, with the forward in the configured precision."""

    def __init__(self, model: nn.Module, optimizer: CombinedOptimizer, config: TrainingConfig,
                 device: torch.device) -> None:  # fmt: skip
        def forward(batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            with autocast(config, device):
                return model(batch)

        self.pipeline = TrainPipelineSparseDist(model, optimizer, device, custom_model_fwd=forward)

    def step(self, batches: Iterator[Batch]) -> StepOutput:
        return self.pipeline.progress(batches)  # DLRMTrain's (loss, logits, labels), detached

    def pause(self) -> nn.Module:
        # Restores the sharded modules' own forwards; batches in flight stay queued, and the
        # next `step` re-attaches the pipeline.
        return self.pipeline.detach()


def train_steps(model: nn.Module, optimizer: CombinedOptimizer, config: TrainingConfig,
                device: torch.device, managed_ids: bool = False, world_size: int = 1) -> TrainSteps:  # fmt: skip
    if pipeline_kind(config, device, managed_ids, world_size) == "sparse_dist":
        return PipelinedSteps(model, optimizer, config, device)
    return PlainSteps(model, optimizer, config, device)
