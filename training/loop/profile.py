"""Where a training step's time goes: a few steps under torch's profiler, each operator's
own time put into one of the step's parts, and every rank's peak memory.

    data           waiting for the next batch and copying it to the device
    embedding      the embedding lookups and their backward (fbgemm; on GPUs its fused
                   optimizer update runs inside that backward, so it is counted here)
    dense          the interaction, the MLPs and the loss, forward and backward
    communication  the all-to-alls of ids and pooled embeddings, the gradients' all-reduce
    optimizer      the dense optimizer's step and zeroing the gradients
    other          the step's wall time that no operator accounts for (Python, launches,
                   waits); never below zero

On a GPU the kernels' and copies' device time is counted, each in the part of the operator
that launched it; on a CPU the operators' own CPU time in the training thread (a reader
thread's work beside it is not the step's). Kernels of several streams can overlap, so on a
GPU the parts can sum past the wall time (`other` is then 0).
An operator is put in the part its own name says, else in the part of the nearest labelled
region around it (TorchRec's pipeline labels its copies, all-to-alls and optimizer step),
else in `dense`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

DATA_LABEL = "dlrm.data"
PARTS = ("data", "embedding", "dense", "communication", "optimizer")

# name fragments (lower case) → part; the first part whose fragment an operator's name, or
# else its nearest enclosing region's, contains
_FRAGMENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("all2all", "alltoall", "all_to_all", "allreduce", "all_reduce", "all_gather", "allgather",
                       "reduce_scatter", "nccl", "gloo", "c10d::", "sparse_data_dist", "broadcast")),
    ("data", (DATA_LABEL, "copy_batch_to_gpu", "load_batch", "next_batch", "wait_for_batch")),
    # before the optimizer: an embedding's update (fbgemm's fused row-wise Adagrad, or this
    # project's CPU kernel) is the embedding's own backward
    ("embedding", ("fbgemm", "embedding", "tbe", "lookup", "rowwise_adagrad")),
    ("optimizer", ("optimizer", "zero_grad", "adam", "adagrad")),
)  # fmt: skip


def part_of(name: str) -> str | None:
    """The part an operator or region name says it belongs to (None: it does not say)."""
    lowered = name.lower()
    for part, fragments in _FRAGMENTS:
        if any(fragment in lowered for fragment in fragments):
            return part
    return None


def classify(name: str, enclosing: list[str]) -> str:
    """The part of an operator: its own name's, else the nearest enclosing region's, else dense."""
    for candidate in [name, *enclosing]:
        part = part_of(candidate)
        if part is not None:
            return part
    return "dense"


@dataclass(frozen=True)
class StepProfile:
    """Milliseconds per step in each part, over `steps` profiled steps (rank 0's), and the
    peak memory of every rank."""

    steps: int
    timing: str  # "device" (GPU kernels' time) or "cpu" (the training thread's operators)
    wall_ms: float  # the profiled steps' wall time per step (the profiler's cost included)
    data_ms: float
    embedding_ms: float
    dense_ms: float
    communication_ms: float
    optimizer_ms: float
    other_ms: float
    peak_memory_mb: list[float]  # per rank: CUDA's peak allocation, or the process's peak RSS

    def parts_ms(self) -> dict[str, float]:
        return {part: getattr(self, f"{part}_ms") for part in (*PARTS, "other")}


class StepProfiler:
    """Profiles steps `first_step + 1` … `last_step` of the loop (the last ones: the timed
    windows before them are not slowed by the profiler)."""

    def __init__(self, steps: int, total_steps: int, device: torch.device) -> None:
        self.steps = min(steps, max(0, total_steps - 1))
        self.first_step, self.last_step, self.device = total_steps - self.steps, total_steps, device
        self.profiler: torch.profiler.profile | None = None
        self.started = 0.0
        self.parts: dict[str, float] = {}
        self.wall_ms = 0.0

    @property
    def active(self) -> bool:
        return self.steps > 0

    def labelled(self, batches: Iterator) -> Iterator:
        """The batches, each wait for the next one labelled as data (a no-op unless profiling)."""
        while True:
            with record_function(DATA_LABEL):
                try:
                    batch = next(batches)
                except StopIteration:
                    return
            yield batch

    def stepped(self, step: int) -> None:
        """Called after each step: starts the profiler before its first step, stops after its last."""
        if not self.active:
            return
        if step == self.first_step:
            self._synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.started = time.perf_counter()
        elif step == self.last_step and self.profiler is not None:
            self._synchronize()
            self.wall_ms = (time.perf_counter() - self.started) * 1000 / self.steps
            self.profiler.__exit__(None, None, None)
            self.parts = self._parts(self.profiler)
            self.profiler = None

    def result(self) -> StepProfile | None:
        """Every rank's peak memory gathered (collective: every rank calls it); rank 0's parts."""
        peaks = gathered_peak_memory_mb(self.device)
        if not self.parts:
            return None
        parts = {part: self.parts.get(part, 0.0) for part in PARTS}
        other = max(0.0, self.wall_ms - sum(parts.values()))
        return StepProfile(steps=self.steps, timing="device" if self.device.type == "cuda" else "cpu",
                           wall_ms=round(self.wall_ms, 4), **{f"{k}_ms": round(v, 4) for k, v in parts.items()},
                           other_ms=round(other, 4), peak_memory_mb=peaks)  # fmt: skip

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _parts(self, profiler: torch.profiler.profile) -> dict[str, float]:
        events = profiler.events()
        timed = _device_parts(events) if self.device.type == "cuda" else _cpu_parts(events)
        return {part: us / 1000 / self.steps for part, us in timed.items()}


def _cpu_parts(events) -> dict[str, float]:
    """Each operator's own CPU time (µs), by part. The profiler records the thread that
    started it, the training thread (a CPU backward runs there too), not the reader's."""
    totals: dict[str, float] = {}
    for event in events:
        if event.device_type == DeviceType.CPU and event.self_cpu_time_total > 0:
            part = classify(event.name, _enclosing(event))
            totals[part] = totals.get(part, 0.0) + event.self_cpu_time_total
    return totals


def _device_parts(events) -> dict[str, float]:
    """Each kernel's (and copy's) device time (µs), by the part of the operator that
    launched it, found through its correlation id; a kernel with no recorded launcher (one
    queued from a thread the profiler does not follow) by its own name."""
    launchers = {event.id: event for event in events if event.device_type == DeviceType.CPU}
    totals: dict[str, float] = {}
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        launcher = launchers.get(getattr(event, "linked_correlation_id", 0))
        part = classify(launcher.name, _enclosing(launcher)) if launcher is not None else classify(event.name, [])
        totals[part] = totals.get(part, 0.0) + (event.time_range.end - event.time_range.start)
    return totals


def _enclosing(event) -> list[str]:
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak: CUDA's peak allocation on a GPU, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):  # ru_maxrss is not reset by exec: this is our own
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gathered_peak_memory_mb(device: torch.device) -> list[float]:
    """Every rank's `peak_memory_mb`, in rank order (collective)."""
    mine = torch.tensor([peak_memory_mb(device)], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [round(float(value), 1) for value in torch.cat(every).cpu()]
