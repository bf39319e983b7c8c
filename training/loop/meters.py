"""What the training loop measures as it goes: its training time, and the NE of the
batches it trains."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from evaluation.distributed import reduced_state, tensor_state
from training.loop.progress import Progress
from training.model.objective import real_rows


class TrainTimer:
    """From the end of this launch's first step (it compiles and warms up; unless it is the
    only step) to the end, less the pauses for evaluations and checkpoints."""

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
    """This rank's NE sums since the last logged step, added up on the device; at a logged
    step (the same steps on every rank) one small all-reduce sums them over the ranks, and
    rank 0 reports."""

    def __init__(self, progress: Progress, device: torch.device, log_every: int) -> None:
        self.progress, self.device, self.log_every = progress, device, log_every
        self.pending = torch.zeros(4, dtype=torch.float64, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.pending += tensor_state(labels, torch.sigmoid(logits.double()), real_rows(labels))

    def maybe_log(self, step: int, loss: torch.Tensor) -> None:
        if step % self.log_every != 0 and step != self.progress.total_steps:
            return
        self.progress.add(reduced_state(self.pending))
        self.pending.zero_()
        if dist.get_rank() == 0:
            self.progress.report(step, float(loss))
