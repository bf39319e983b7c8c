"""The training and prediction loops over a sharded model (any world size, any device)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from evaluation.distributed import all_reduce_state
from evaluation.metrics import BinaryState
from ingestion.reader import PAD_LABEL, build_reader
from training.config import TrainingConfig
from training.job import TrainJob
from training.progress import Progress


@dataclass(frozen=True)
class TrainStats:
    steps: int
    samples: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def attach_embedding_optimizer(model: nn.Module, config: TrainingConfig) -> None:
    """Row-wise Adagrad fused into the embedding backward (applied before sharding)."""
    embedding_params = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    apply_optimizer_in_backward(RowWiseAdagrad, embedding_params, {"lr": config.embedding_lr})


def build_optimizer(model: nn.Module, config: TrainingConfig) -> CombinedOptimizer:
    """The sharded model's fused embedding optimizer plus a dense optimizer for the MLPs."""
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    if config.dense_optimizer == "adam":
        dense_opt = KeyedOptimizerWrapper(dense, lambda p: torch.optim.Adam(p, lr=config.dense_lr))
    else:
        dense_opt = KeyedOptimizerWrapper(dense, lambda p: torch.optim.Adagrad(p, lr=config.dense_lr))
    return CombinedOptimizer([model.fused_optimizer, dense_opt])  # type: ignore[attr-defined]


def _step_state(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[count, Σy, Σp, Σ cross entropy] of one local batch, float64, for the all-reduce."""
    logits, labels = logits.detach().double(), labels.detach().double()
    cross_entropy = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return torch.stack([
        torch.tensor(float(labels.numel()), dtype=torch.float64, device=labels.device),
        labels.sum(), torch.sigmoid(logits).sum(), cross_entropy,
    ])  # fmt: skip


def train(model: nn.Module, optimizer: CombinedOptimizer, job: TrainJob, device: torch.device) -> TrainStats:
    """Epochs over the training files; every rank takes the same number of steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = job.training
    readers = [
        build_reader(job.train_files, config.batch_size_per_rank, rank, world, shuffle_seed=config.seed, epoch=e)
        for e in range(config.epochs)
    ]
    total_steps = sum(len(r) for r in readers)
    metrics_path = job.out / "metrics.jsonl" if rank == 0 else None
    progress = Progress(total_steps, config.batch_size, job.evaluation.ne_window, metrics_path)
    model.train()
    step, started = 0, time.perf_counter()
    pending = torch.zeros(4, dtype=torch.float64, device=device)
    for reader in readers:
        for batch in reader:
            batch = batch.to(device, non_blocking=True)
            loss, (_, logits, labels) = model(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            pending += _step_state(logits, labels)
            if step % config.log_every == 0 or step == total_steps:
                # one small all-reduce per logging interval, at the same steps on every rank
                progress.add(all_reduce_state(BinaryState.from_array(pending.cpu().numpy()), device))
                pending.zero_()
                if rank == 0:
                    progress.report(step, float(loss))
    progress.close()
    seconds = time.perf_counter() - started
    return TrainStats(steps=step, samples=step * config.batch_size, seconds=seconds)


@torch.no_grad()
def predict(model: nn.Module, job: TrainJob, device: torch.device, out_path: Path) -> int:
    """Score this rank's share of the evaluation files; write label + prediction to Parquet."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reader = build_reader(job.eval_files, job.evaluation.batch_size, rank, world, drop_remainder=False)
    model.eval()
    labels_out, predictions_out = [], []
    for batch in reader:
        _, (_, logits, labels) = model(batch.to(device, non_blocking=True))
        keep = labels != PAD_LABEL
        labels_out.append(labels[keep].cpu().numpy())
        predictions_out.append(torch.sigmoid(logits[keep].float()).cpu().numpy())
    labels_all = np.concatenate(labels_out) if labels_out else np.zeros(0, np.float32)
    predictions_all = np.concatenate(predictions_out) if predictions_out else np.zeros(0, np.float32)
    table = pa.table({"label": labels_all.astype(np.int8), "prediction": predictions_all.astype(np.float32)})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out_path)
    return table.num_rows
