"""What the training loop measures as it goes: its training time, and the NE of the
batches it trains."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from evaluation.distributed import tensor_state
from evaluation.metrics import BinaryState
from training.loop.progress import Progress
from training.model.objective import real_rows


class TrainTimer:
    """From the end of this launch's first step (it compiles and warms up; unless it is the
    only step) to the end, less the pauses for evaluations and checkpoints."""

    def __init__(self, start_step: int, total_steps: int, device: torch.device) -> None:
        self.start_step, self.total_steps, self.device = start_step, total_steps, device
        self.started = time.perf_counter()
        self.first_step_seconds = 0.0
        self.first_step_apart = False
        self.paused_seconds = 0.0

    def stepped(self, step: int) -> None:
        if step == self.start_step + 1 < self.total_steps:
            self._wait_for_device()
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
        self._wait_for_device()
        return time.perf_counter() - self.started - self.paused_seconds

    def _wait_for_device(self) -> None:
        # a GPU runs behind the Python that queues its work: the clock reads its end
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_steps(self, step: int) -> int:
        return step - self.start_step - (1 if self.first_step_apart else 0)


class TrainingNE:
    """This rank's NE sums of the batches trained since the last logged step. The steps'
    outputs are kept (references to tensors the device already holds) and summed in one
    pass at a logged step (the same steps on every rank); the sums are all-reduced over the
    ranks without waiting (one process: nothing to reduce) and copied to the host behind
    the device's queue, and rank 0 reports them at the next logged step, when they are long
    there. So a logged step makes the host wait neither for the collective nor for the
    device. `flush` reports at once: before a checkpoint (the metrics file then holds every
    record up to the step a resume starts from), a held-out evaluation (records stay in step
    order) and the end."""

    def __init__(self, progress: Progress, device: torch.device, log_every: int) -> None:
        self.progress, self.device, self.log_every = progress, device, log_every
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.pending: _PendingLog | None = None

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.logits.append(logits)  # the steps' outputs are detached already (loop/steps.py)
        self.labels.append(labels)

    def maybe_log(self, step: int, loss: torch.Tensor) -> None:
        if step % self.log_every != 0 and step != self.progress.total_steps:
            return
        if self.logits:
            labels = torch.cat(self.labels)
            sums = tensor_state(labels, torch.sigmoid(torch.cat(self.logits).double()), real_rows(labels))
        else:
            sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        self.logits.clear()
        self.labels.clear()
        earlier, self.pending = self.pending, _PendingLog.start(step, sums, loss)
        if earlier is not None:
            self._report(earlier)
        if step == self.progress.total_steps:
            self.flush()

    def flush(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._report(pending)

    def _report(self, pending: _PendingLog) -> None:
        sums, loss = pending.result()
        self.progress.add(BinaryState.from_array(sums))
        if dist.get_rank() == 0:
            self.progress.report(pending.step, loss, pending.at)


@dataclass
class _PendingLog:
    """A logged step's NE sums on their way: all-reduced over the ranks (gloo: in flight;
    NCCL: queued on the device) and, on a CUDA device, copied to the host with its loss
    behind the step's work."""

    step: int
    at: float  # when the step was logged (time.perf_counter): its record's time, whenever reported
    sums: torch.Tensor  # [4] float64, reduced in place (on the host once `result` returns)
    loss: torch.Tensor  # this rank's loss at the step
    work: dist.Work | None  # the collective, where the host must wait for it (gloo)
    copied: torch.cuda.Event | None  # the copy to the host (a CUDA device)

    @classmethod
    def start(cls, step: int, sums: torch.Tensor, loss: torch.Tensor) -> _PendingLog:
        at = time.perf_counter()
        work = dist.all_reduce(sums, async_op=True) if dist.get_world_size() > 1 else None
        if not sums.is_cuda:
            return cls(step, at, sums, loss, work, None)
        if work is not None:
            work.wait()  # NCCL: the device's queue waits for the collective, not the host
        host = torch.empty(5, dtype=torch.float64, pin_memory=True)
        host.copy_(torch.cat([sums, loss.detach().double().reshape(1)]), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(step, at, host[:4], host[4:], None, copied)

    def result(self) -> tuple[np.ndarray, float]:
        """The reduced sums and the loss, on the host (waiting only for what is not there yet)."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.work is not None:
            self.work.wait()
        return self.sums.numpy(), float(self.loss)
