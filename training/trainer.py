"""The training and prediction loops over a sharded model (any world size, any device)."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from evaluation.distributed import all_reduce_state
from evaluation.metrics import BinaryState
from ingestion.reader import PAD_LABEL, BatchReader, build_reader, example_of_values, first_ids
from training.checkpoint import RowLedger, TrainPosition, save_checkpoint
from training.config import TrainingConfig
from training.job import TrainJob
from training.progress import Progress
from training.schedule import LRSchedule
from training.steps import StepOutput, TrainSteps, autocast, train_steps


@dataclass(frozen=True)
class TrainStats:
    steps: int  # the step training ended at (counting steps before a resume)
    samples: int  # samples trained by this launch after its first step
    seconds: float  # their training time (evaluations and checkpoints excluded)
    first_step_seconds: float  # compilation, allocation and cache warm-up happen here
    ledger: RowLedger
    position: TrainPosition

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class EmbeddingRowWiseAdagrad(RowWiseAdagrad):
    """TorchRec's row-wise Adagrad, also taking the keys only fbgemm's fused kernel reads
    (its optimizer type and weight-decay mode): TorchRec hands a parameter's in-backward
    optimizer arguments to the sharded tables as they are."""

    def __init__(self, params, lr: float, eps: float, weight_decay: float = 0.0, weight_decay_mode=None,
                 optimizer=None) -> None:  # fmt: skip
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay)


def attach_embedding_optimizer(model: nn.Module, config: TrainingConfig) -> None:
    """Row-wise Adagrad fused into the embedding backward (applied before sharding), with
    L2 on the rows each step touches when `embedding_weight_decay` is set."""
    embedding_params = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    arguments: dict[str, Any] = {"lr": config.embedding_lr, "eps": config.embedding_eps,
                                 "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}  # fmt: skip
    if config.embedding_weight_decay:
        arguments.update(weight_decay=config.embedding_weight_decay, weight_decay_mode=WeightDecayMode.L2)
    apply_optimizer_in_backward(EmbeddingRowWiseAdagrad, embedding_params, arguments)


def build_schedule(model: nn.Module, optimizer: CombinedOptimizer, config: TrainingConfig) -> LRSchedule:
    """The learning-rate schedule over both optimizers (build it before loading a checkpoint)."""
    fused = model.fused_optimizer  # type: ignore[attr-defined]
    return LRSchedule(optimizer, config.warmup_steps, config.lr_decay, config.min_lr_fraction, push=fused.step,
                      warmup_fraction=config.warmup_fraction)


def build_optimizer(model: nn.Module, config: TrainingConfig) -> CombinedOptimizer:
    """The sharded model's fused embedding optimizer plus a dense optimizer for the MLPs."""
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    if config.dense_optimizer == "adam":
        optimizer_class = torch.optim.Adam
    else:
        optimizer_class = torch.optim.Adagrad
    device = next(iter(dense.values())).device
    hyper = {"lr": config.dense_lr, "weight_decay": config.dense_weight_decay,
             "fused": fused_dense_optimizer(config.dense_optimizer, device)}  # fmt: skip
    dense_opt = KeyedOptimizerWrapper(dense, lambda p: optimizer_class(p, **hyper))
    return CombinedOptimizer([model.fused_optimizer, dense_opt])  # type: ignore[attr-defined]


def fused_dense_optimizer(name: str, device: torch.device) -> bool:
    """Whether torch has a fused kernel for the dense optimizer on `device`: one kernel over
    all the MLPs' tensors instead of a chain of `foreach` ops (a step of Adam over this
    model's MLPs: 1.04 → 0.16 ms on 2 CPU cores; Adagrad 0.34 → 0.12 ms). Adagrad's fused
    kernel exists for CPU only."""
    return device.type == "cpu" or (device.type == "cuda" and name == "adam")


def _step_state(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[count, Σy, Σp, Σ cross entropy] of one local batch, float64, for the all-reduce."""
    logits, labels = logits.detach().double(), labels.detach().double()
    cross_entropy = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return torch.stack([
        torch.tensor(float(labels.numel()), dtype=torch.float64, device=labels.device),
        labels.sum(), torch.sigmoid(logits).sum(), cross_entropy,
    ])  # fmt: skip


def reader_prefetch(config: TrainingConfig) -> int:
    """Batches to decode ahead in a background thread: only when a core is free for it.

    Measured on 2 cores with 2 compute threads: a reader thread beside them cut training
    throughput from 38.8k to 29.8k samples/s; reading in the training thread kept 38.8k.
    """
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", config.nproc))
    spare_cores = (os.cpu_count() or 1) - local_processes * config.threads_per_proc
    return 4 if spare_cores >= 1 else 0


def row_hashes(batch) -> torch.Tensor:
    """A 64-bit hash per row of a batch (ids and label), for the trained-rows fingerprint."""
    kjt = batch.sparse_features
    # each id weighted by its feature, summed per example (multi-hot bags included)
    feature_weights = torch.arange(1, len(kjt.keys()) + 1, dtype=torch.int64).mul_(0x9E3779B1)
    ids = kjt.values().cpu().to(torch.int64)  # the batch's own tensor when int64 on CPU: never in place
    lengths = kjt.lengths()
    if ids.numel() == lengths.numel() and bool(lengths.eq(1).all()):
        # one id per feature and example (values are feature-major): a [F, B] product, no
        # per-value scatter (0.48 → 0.15 ms at batch 2048); the same sums, wrapping alike
        summed = (ids.view(len(kjt.keys()), -1) * feature_weights.unsqueeze(1)).sum(0)
    else:
        weights = torch.repeat_interleave(feature_weights, torch.tensor(kjt.length_per_key()))
        summed = torch.zeros(len(batch.labels), dtype=torch.int64).index_add_(
            0, example_of_values(kjt).cpu(), ids * weights
        )
    return summed * 31 + batch.labels.cpu().to(torch.int64)  # wraps mod 2**64


@dataclass(frozen=True)
class ReadBatch:
    """Where a batch read for training came from, and its rows' hashes for the ledger."""

    epoch: int
    index: int  # within the epoch
    row_hashes: torch.Tensor


class TrainBatches:
    """This rank's training batches from `start` to the end of the last epoch.

    The sparse-dist pipeline reads up to two batches ahead of the one it trains, and the
    batches train in the order they were read: so the oldest batch read and not yet trained
    (`pop_trained`) is the one a step just trained. The ledger and the checkpoint position
    follow trained batches, never the ones in flight (a resume reads those again).
    """

    def __init__(self, job: TrainJob, device: torch.device, start: TrainPosition) -> None:
        self.job, self.device, self.start = job, device, start
        self.prefetch = reader_prefetch(job.training)
        self.steps_per_epoch = self._reader(0).num_batches
        self._read: deque[ReadBatch] = deque()
        self.last_trained: ReadBatch | None = None
        self.stream = self._batches()

    def pop_trained(self) -> ReadBatch:
        """The batch the step that just ran trained: the oldest one read and not yet trained."""
        self.last_trained = self._read.popleft()
        return self.last_trained

    def position(self, step: int) -> TrainPosition:
        """Where training stands after step `step`, which trained `last_trained`."""
        trained = self.last_trained
        assert trained is not None, "no batch trained yet"
        if trained.index + 1 < self.steps_per_epoch:
            return TrainPosition(step, trained.epoch, trained.index + 1)
        return TrainPosition(step, trained.epoch + 1, 0)

    def close(self) -> None:
        self.stream.close()

    def _reader(self, epoch: int, first_batch: int = 0) -> BatchReader:
        config = self.job.training
        # every row trained: the last batch of an epoch is padded, and padding weighs nothing
        # (training/objective.py)
        world = dist.get_world_size()
        return build_reader(self.job.train_files, config.batch_per_rank(world), dist.get_rank(), world,
                            shuffle_seed=config.seed, epoch=epoch, start_batch=first_batch, drop_remainder=False,
                            prefetch=self.prefetch)  # fmt: skip

    def _batches(self) -> Iterator[Batch]:
        for epoch in range(self.start.epoch, self.job.training.epochs):
            first = self.start.batch if epoch == self.start.epoch else 0
            for index, batch in enumerate(self._reader(epoch, first), start=first):
                self._read.append(ReadBatch(epoch, index, row_hashes(batch)[batch.labels != PAD_LABEL]))
                # page-locked, so the copy to the GPU is asynchronous and overlaps the step
                yield batch.pin_memory() if self.device.type == "cuda" else batch


class TrainTimer:
    """Training time as throughput counts it: from the end of this launch's first step
    (it compiles and warms up; unless it is the only step) to the end, less the pauses for
    evaluations and checkpoints."""

    def __init__(self, start_step: int, total_steps: int) -> None:
        self.start_step, self.total_steps = start_step, total_steps
        self.started = time.perf_counter()
        self.first_step_seconds = 0.0
        self.first_step_apart = False
        self.paused_seconds = 0.0

    def stepped(self, step: int) -> None:
        if step == self.start_step + 1 < self.total_steps:
            now = time.perf_counter()
            self.first_step_seconds, self.started, self.first_step_apart = now - self.started, now, True

    @contextmanager
    def paused(self) -> Iterator[None]:
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - paused

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused_seconds

    def timed_steps(self, step: int) -> int:
        return step - self.start_step - (1 if self.first_step_apart else 0)


class TrainingNE:
    """This rank's NE sums since the last logged step; at a logged step (the same steps on
    every rank) one small all-reduce sums them over the ranks, and rank 0 reports."""

    def __init__(self, progress: Progress, device: torch.device, log_every: int) -> None:
        self.progress, self.device, self.log_every = progress, device, log_every
        self.pending = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        real = labels != PAD_LABEL
        self.pending += _step_state(logits[real], labels[real])

    def maybe_log(self, step: int, loss: torch.Tensor) -> None:
        if step % self.log_every != 0 and step != self.progress.total_steps:
            return
        self.progress.add(all_reduce_state(BinaryState.from_array(self.pending.cpu().numpy()), self.device))
        self.pending.zero_()
        if dist.get_rank() == 0:
            self.progress.report(step, float(loss))


def train(
    model: nn.Module,
    optimizer: CombinedOptimizer,
    job: TrainJob,
    device: torch.device,
    schedule: LRSchedule,
    start: TrainPosition | None = None,
    ledger: RowLedger | None = None,
) -> TrainStats:
    """Epochs over the training files from `start`; every rank takes the same steps.

    Checkpoints every `checkpoint_every` steps; returns when the last epoch is done.
    """
    config = job.training
    start = start or TrainPosition(step=0, epoch=0, batch=0)
    ledger = ledger or RowLedger()
    batches = TrainBatches(job, device, start)
    total_steps = batches.steps_per_epoch * config.epochs
    metrics_path = job.out / "metrics.jsonl" if dist.get_rank() == 0 else None
    progress = Progress(total_steps, config.batch_size, job.evaluation.ne_window, metrics_path)
    ne = TrainingNE(progress, device, config.log_every)
    model.train()
    steps = train_steps(model, optimizer, config, device)
    timer = TrainTimer(start.step, total_steps)
    step = start.step
    while step < total_steps:
        loss, logits, labels = train_step(steps, batches, schedule, ledger, step, total_steps)
        step += 1
        timer.stepped(step)
        ne.add(logits, labels)
        maybe_evaluate(steps, job, device, progress, timer, step, batches.steps_per_epoch)
        ne.maybe_log(step, loss)
        maybe_checkpoint(model, optimizer, job, batches, ledger, timer, step, total_steps)
    steps.pause()  # the model's own forward again, for the final checkpoint and predictions
    batches.close()
    progress.close()
    return TrainStats(steps=step, samples=timer.timed_steps(step) * config.batch_size, seconds=timer.seconds(),
                      first_step_seconds=timer.first_step_seconds, ledger=ledger,
                      position=TrainPosition(step, config.epochs, 0))  # fmt: skip


def train_step(steps: TrainSteps, batches: TrainBatches, schedule: LRSchedule, ledger: RowLedger, step: int,
               total_steps: int) -> StepOutput:  # fmt: skip
    """Train step `step + 1` at its scheduled rates, and account the batch it trained."""
    schedule.apply(step, total_steps)
    output = steps.step(batches.stream)
    ledger.add(batches.pop_trained().row_hashes)
    return output


def maybe_evaluate(steps: TrainSteps, job: TrainJob, device: torch.device, progress: Progress, timer: TrainTimer,
                   step: int, steps_per_epoch: int) -> None:  # fmt: skip
    """Held-out NE every `heldout_every_steps` steps, at every epoch end when
    `heldout_every_epoch`, and at the last step of either (not training time)."""
    every, config = job.evaluation.heldout_every_steps, job.evaluation
    periodic = bool(every) and (step % every == 0 or step == progress.total_steps)
    if periodic or (config.heldout_every_epoch and step % steps_per_epoch == 0):
        with timer.paused():
            progress.add_heldout(step, heldout_state(steps.pause(), job, device))


def maybe_checkpoint(model: nn.Module, optimizer: CombinedOptimizer, job: TrainJob, batches: TrainBatches,
                     ledger: RowLedger, timer: TrainTimer, step: int, total_steps: int) -> None:  # fmt: skip
    """A checkpoint every `checkpoint_every` steps before the last (the worker writes the
    last), at the position after the batch this step trained (not training time)."""
    every = job.training.checkpoint_every
    if every and step % every == 0 and step < total_steps:
        with timer.paused():
            save_checkpoint(model, optimizer, job.checkpoint_root, batches.position(step),
                            ledger, job.training.keep_checkpoints)  # fmt: skip


@torch.no_grad()
def heldout_state(model: nn.Module, job: TrainJob, device: torch.device) -> BinaryState:
    """The summed state of the first few eval batches on every rank (same count everywhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = [f for day_files in job.eval_files.values() for f in day_files]
    reader = build_reader(files, job.evaluation.batch_size, rank, world, drop_remainder=False, prefetch=0)
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for index, batch in enumerate(reader):
        if index == job.evaluation.heldout_batches > 0:  # 0: every batch
            break
        with autocast(job.training, device):
            _, (_, logits, labels) = model(batch.to(device, non_blocking=True))
        keep = labels != PAD_LABEL
        sums += _step_state(logits[keep], labels[keep])
    model.train()
    return all_reduce_state(BinaryState.from_array(sums.cpu().numpy()), device)


@torch.no_grad()
def predict(model: nn.Module, job: TrainJob, device: torch.device, out_dir: Path) -> int:
    """Score this rank's share of each evaluation day into `out_dir/day=N/rank-R.parquet`.

    Columns: label, prediction, and `slice`, the row's index of the slice feature.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    rows = 0
    for day, files in job.eval_files.items():
        columns: dict[str, list[np.ndarray]] = {"label": [], "prediction": [], "slice": []}
        for batch in build_reader(files, job.evaluation.batch_size, rank, world, drop_remainder=False):
            with autocast(job.training, device):
                _, (_, logits, labels) = model(batch.to(device, non_blocking=True))
            keep = (labels != PAD_LABEL).cpu()
            ids = first_ids(batch.sparse_features, job.evaluation.slice_feature)
            columns["label"].append(labels.cpu()[keep].numpy().astype(np.int8))
            columns["prediction"].append(torch.sigmoid(logits.float()).cpu()[keep].numpy())
            columns["slice"].append(ids[keep].numpy().astype(np.int32))
        table = pa.table({name: np.concatenate(parts) for name, parts in columns.items()})
        path = out_dir / f"day={day}" / f"rank-{rank:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        rows += table.num_rows
    return rows
