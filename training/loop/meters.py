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
    pass at a logged step (the same steps on every rank), where one small all-reduce sums
    them over the ranks and rank 0 reports: between logged steps the loop queues no work
    for them and never waits for the device."""

    def __init__(self, progress: Progress, device: torch.device, log_every: int) -> None:
        self.progress, self.device, self.log_every = progress, device, log_every
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.logits.append(logits.detach())
        self.labels.append(labels.detach())

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
        self.progress.add(reduced_state(sums))
        if dist.get_rank() == 0:
            self.progress.report(step, float(loss))
