"""Training progress: console lines with samples/s and ETA, and a metrics file for tracking."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from evaluation.metrics import BinaryState, MetricError, compute_ne


class Progress:
    """Windowed and lifetime NE from summed states; one JSON line per logged step (rank 0)."""

    def __init__(self, total_steps: int, global_batch: int, window: int, metrics_path: Path | None) -> None:
        self.total_steps, self.global_batch, self.window = total_steps, global_batch, window
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
        ne = _ne_or_nan(state)
        if self.metrics_file:
            record = {"step": step, "samples_seen": step * self.global_batch, "heldout_ne": ne}
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
            # A fixed format: the tuner reads it from the launcher's output to prune early.
            print(f"[train] step {step}/{self.total_steps} held-out NE {ne:.6f}", flush=True)

    def report(self, step: int, loss: float) -> dict:
        now = time.perf_counter()
        steps = step - self.interval_start_step
        samples_per_s = steps * self.global_batch / max(now - self.interval_started, 1e-9)
        self.interval_started, self.interval_start_step = now, step
        elapsed = now - self.started
        eta = elapsed / step * (self.total_steps - step) if step else float("nan")
        record = {
            "step": step,
            "samples_seen": step * self.global_batch,
            "loss": loss,
            "train_window_ne": _ne_or_nan(self.recent_state),
            "train_lifetime_ne": _ne_or_nan(self.lifetime),
            "samples_per_s": samples_per_s,
            "elapsed_s": elapsed,
        }
        print(
            f"[train] step {step}/{self.total_steps} ({100 * step / max(self.total_steps, 1):.0f}%) "
            f"loss {loss:.4f} NE(window) {record['train_window_ne']:.4f} "
            f"{samples_per_s:,.0f} samples/s ETA {eta:,.0f}s",
            flush=True,
        )
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        return record

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()


def _ne_or_nan(state: BinaryState) -> float:
    try:
        return compute_ne(state)
    except MetricError:
        return float("nan")
