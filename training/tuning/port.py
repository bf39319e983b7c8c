"""The port workflow's figures (`tuning.policy = "characterize_then_retune"`, `dlrm port`).

Acun et al. 2021 (§V, Fig. 15): moved to new hardware, a DLRM trains at that hardware's
batch size, and even retuned its NE trails the smaller batch's by 0.1–0.2 %, which matters.
So a port reports, beside the hardware's batch, the NE gap against the nearest tuned key at
its own batch (both keys' best validation NE, on the same validation rows of the same
config), and how long the ported run trained to reach the NE that key's newest run ended at.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.loop.progress import HeldoutRecord, MetricsRecord, TrainRecord


@dataclass(frozen=True)
class PortFacts:
    hardware_batch_size: int  # where the new hardware's throughput saturates (dlrm characterize)
    saturated: bool  # False: the sweep's largest batch still gained (then that batch)
    characterize_run_id: str  # the MLflow run with the curve
    hardware_samples_per_s: float  # the characterization's throughput at that batch
    nearest_key: str = ""  # the nearest tuned key on other hardware (its fingerprint), if any
    nearest_batch: int = 0
    nearest_ne: float | None = None  # its best validation NE
    retuned_ne: float | None = None  # this key's best validation NE after the retune
    old_run_heldout_ne: float | None = None  # the NE the nearest key's newest run ended at (held-out sample)
    old_run_seconds: float | None = None  # that run's training time
    seconds_to_old_ne: float | None = None  # this run's training time until its held-out NE reached it

    @property
    def ne_gap(self) -> float | None:
        """Retuned NE − the nearest key's (positive: the new batch trails)."""
        if self.retuned_ne is None or self.nearest_ne is None:
            return None
        return self.retuned_ne - self.nearest_ne

    @property
    def ne_gap_percent(self) -> float | None:
        gap = self.ne_gap
        return None if gap is None or not self.nearest_ne else 100 * gap / self.nearest_ne

    def as_dict(self) -> dict[str, object]:
        from dataclasses import asdict

        return {**asdict(self), "ne_gap": self.ne_gap, "ne_gap_percent": self.ne_gap_percent}


def seconds_to_reach(records: list[MetricsRecord], target_ne: float) -> float | None:
    """Training seconds until the first held-out NE at or below `target_ne` (None: never).

    Held-out records carry a step, not a time: the time at that step is interpolated
    between the training records around it (each logs the seconds since training began).
    """
    times = [(r.step, r.elapsed_s) for r in records if isinstance(r, TrainRecord)]
    for record in records:
        if isinstance(record, HeldoutRecord) and record.heldout_ne <= target_ne:
            return _time_at(times, record.step)
    return None


def _time_at(times: list[tuple[int, float]], step: int) -> float | None:
    if not times:
        return None
    before = [t for t in times if t[0] <= step]
    after = [t for t in times if t[0] >= step]
    if not before:
        return after[0][1] * step / after[0][0] if after[0][0] else after[0][1]
    if not after:
        return before[-1][1]
    (s0, t0), (s1, t1) = before[-1], after[0]
    return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
