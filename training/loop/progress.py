"""Training progress: console lines for people, and the metrics file for programs.

The metrics file (`JobFolder.metrics`, written by rank 0) holds one JSON object a line,
appended as training goes; it is how progress and held-out NE reach the flows (the
Prefect progress artifact, the tuner's pruner, MLflow's history). Its records:

- `TrainRecord` (`"kind": "train"`), every `training.log_every` steps and at the last step:
  loss, windowed and lifetime NE of the training batches, throughput;
- `HeldoutRecord` (`"kind": "heldout"`), every `evaluation.heldout_every_steps` steps and
  at the last step: NE on a fixed sample of the held-out days.

Both carry `step`, `total_steps` (percent done = 100 · step / total_steps),
`steps_per_epoch` (an epoch ends at each multiple) and `samples_seen`. A resumed run
rewrites the file to the records up to its checkpoint's step (replacing it: a new file),
then appends again from there. `MetricsFollower` reads the
records appended since its last call; the console lines are for people and nobody parses them.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from evaluation.metrics import BinaryState, MetricError, compute_ne
from training.codec import SchemaError, decode, encode


@dataclass(frozen=True)
class TrainRecord:
    """Training metrics at a logged step (summed over every rank's batches)."""

    step: int
    total_steps: int
    samples_seen: int  # step × global batch size
    loss: float  # rank 0's loss on the step's batch
    train_window_ne: float  # NE over about the last `evaluation.ne_window` training samples
    train_lifetime_ne: float  # NE over every training sample of this launch
    samples_per_s: float  # since the previous logged step
    elapsed_s: float  # since this launch's training loop started
    steps_per_epoch: int = field(kw_only=True)  # an epoch ends at each multiple
    kind: Literal["train"] = "train"


@dataclass(frozen=True)
class HeldoutRecord:
    """NE on the first `evaluation.heldout_batches` batches of the held-out days, at a step."""

    step: int
    total_steps: int
    samples_seen: int
    heldout_ne: float  # NaN when it cannot be computed (e.g. NaN predictions)
    steps_per_epoch: int = field(kw_only=True)
    kind: Literal["heldout"] = "heldout"


MetricsRecord = TrainRecord | HeldoutRecord
RECORD_KINDS: dict[str, type[MetricsRecord]] = {"train": TrainRecord, "heldout": HeldoutRecord}


def record_line(record: MetricsRecord) -> str:
    """The record as one line of the metrics file (`kind` first, for people reading it)."""
    fields = encode(record)
    return json.dumps({"kind": fields.pop("kind"), **fields}) + "\n"


def parse_record(line: str, where: str = "metrics record") -> MetricsRecord:
    """One line of the metrics file as its record; `SchemaError` if it is not one."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise SchemaError(f"{where}: not JSON ({error}): {line[:200]!r}") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in RECORD_KINDS:
        raise SchemaError(f"{where}: unknown record kind {kind!r} (expected one of {list(RECORD_KINDS)})")
    return decode(RECORD_KINDS[kind], data, where)


def read_records(path: Path) -> list[MetricsRecord]:
    """Every complete record in a metrics file (none if there is no file)."""
    return MetricsFollower(path).read_new()


def metric_values(record: MetricsRecord) -> dict[str, float]:
    """The record's measurements by name, with `step` and `samples_seen` (as MLflow logs them)."""
    values = encode(record)
    del values["kind"], values["total_steps"], values["steps_per_epoch"]
    return values


class MetricsFollower:
    """Reads a metrics file as it grows: each `read_new()` returns the records appended since
    the previous call. A line still being written stays unread until its newline arrives.
    When the file is replaced or truncated (a resumed run rewrites it), reading starts over
    at the new file's beginning, so a step may come again after a resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[MetricsRecord]:
        try:
            with self.path.open("rb") as file:
                status = os.fstat(file.fileno())
                if status.st_ino != self._inode or status.st_size < self._offset:
                    self._inode, self._offset, self._partial = status.st_ino, 0, b""
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [parse_record(line.decode(), str(self.path)) for line in lines if line.strip()]


class Progress:
    """Windowed and lifetime NE from summed states; one record per logged step (rank 0)."""

    def __init__(self, total_steps: int, steps_per_epoch: int, global_batch: int, window: int,
                 metrics_path: Path | None) -> None:  # fmt: skip
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.global_batch, self.window = global_batch, window
        self.metrics_file = metrics_path.open("a") if metrics_path else None
        self.started = time.perf_counter()
        self.interval_started = self.started
        self.interval_start_step = 0
        self.lifetime = BinaryState()
        self.recent: deque[BinaryState] = deque()
        self.recent_state = BinaryState()

    def add(self, state: BinaryState) -> None:
        """Account one step's global state (already summed over ranks)."""
        self.lifetime = self.lifetime + state
        self.recent.append(state)
        self.recent_state = self.recent_state + state
        while len(self.recent) > 1 and self.recent_state.count - self.recent[0].count >= self.window:
            oldest = self.recent.popleft()
            self.recent_state = BinaryState.from_array(self.recent_state.as_array() - oldest.as_array())

    def add_heldout(self, step: int, state: BinaryState) -> None:
        """NE on a fixed sample of the held-out days at this step (rank 0 writes it)."""
        if self.metrics_file:
            record = HeldoutRecord(step, self.total_steps, step * self.global_batch, _ne_or_nan(state),
                                   steps_per_epoch=self.steps_per_epoch)  # fmt: skip
            self._write(record)
            print(f"[train] step {step}/{self.total_steps} held-out NE {record.heldout_ne:.6f}", flush=True)

    def report(self, step: int, loss: float, at: float | None = None) -> TrainRecord:
        """Step `step`'s record, as of `at` (time.perf_counter; default now): a step's NE
        sums may be reported a logged step later (loop/meters.py), its time is its own."""
        now = time.perf_counter() if at is None else at
        steps = step - self.interval_start_step
        samples_per_s = steps * self.global_batch / max(now - self.interval_started, 1e-9)
        self.interval_started, self.interval_start_step = now, step
        elapsed = now - self.started
        eta = elapsed / step * (self.total_steps - step) if step else float("nan")
        record = TrainRecord(
            step=step,
            total_steps=self.total_steps,
            samples_seen=step * self.global_batch,
            loss=loss,
            train_window_ne=_ne_or_nan(self.recent_state),
            train_lifetime_ne=_ne_or_nan(self.lifetime),
            samples_per_s=samples_per_s,
            elapsed_s=elapsed,
            steps_per_epoch=self.steps_per_epoch,
        )
        print(
            f"[train] step {step}/{self.total_steps} ({100 * step / max(self.total_steps, 1):.0f}%) "
            f"loss {loss:.4f} NE(window) {record.train_window_ne:.4f} "
            f"{samples_per_s:,.0f} samples/s ETA {eta:,.0f}s",
            flush=True,
        )
        self._write(record)
        return record

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()

    def _write(self, record: MetricsRecord) -> None:
        if self.metrics_file:
            self.metrics_file.write(record_line(record))
            self.metrics_file.flush()


def _ne_or_nan(state: BinaryState) -> float:
    try:
        return compute_ne(state)
    except MetricError:
        return float("nan")
