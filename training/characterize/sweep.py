"""A hardware characterization: the batch-size sweep (the seeds' method, Acun et al. 2021
§IV–V) and where its throughput saturates.

Each series holds the other swept keys fixed and doubles the global batch from `first`
until throughput stops rising (the next `patience` doublings each gain less than
`min_gain`: one noisy window on a shared machine moves a point by 10–20 %, so a single flat
doubling does not end the curve), memory runs out, or `last` is passed. The hardware's batch
is the knee: the smallest batch measured whose throughput the best point beats by less than
`min_gain` (doubling past it buys less than that). The curve saturated if the stopping rule
ended it or its best point is not its largest batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from training.characterize.measure import MeasuredPoint, PointResult, SkippedPoint


@dataclass(frozen=True)
class BatchRange:
    first: int  # global batch of the first point
    last: int  # no point beyond this batch
    explicit: tuple[int, ...] = ()  # measure these batches, all of them, in order (no stopping rule)
    min_gain: float = 0.05  # a doubling that gains less than this share has saturated
    patience: int = 2  # ... when this many doublings in a row do

    def __post_init__(self) -> None:
        if self.first < 1 or self.last < self.first:
            raise ValueError(f"batch range: first {self.first} and last {self.last} must satisfy 1 ≤ first ≤ last")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain: {self.min_gain} is not a share in [0, 1)")
        if self.patience < 1:
            raise ValueError(f"patience: {self.patience} must be at least 1")


def saturation_index(rates: list[float], min_gain: float, patience: int = 2) -> int | None:
    """The first point that each of the next `patience` points beats by less than
    `min_gain` (None: none such, or too few points after it)."""
    for index in range(len(rates) - patience):
        if all(later < rates[index] * (1 + min_gain) for later in rates[index + 1 : index + 1 + patience]):
            return index
    return None


def hardware_batch(points: list[MeasuredPoint], min_gain: float, patience: int = 2) -> tuple[MeasuredPoint | None, bool]:
    """A series' knee (see the module), and whether its curve saturated."""
    ordered = sorted(points, key=lambda p: p.batch_size)
    if not ordered:
        return None, False
    best = max(ordered, key=lambda p: p.samples_per_s)
    knee = next(p for p in ordered if best.samples_per_s < p.samples_per_s * (1 + min_gain))
    rates = [p.samples_per_s for p in ordered]
    saturated = saturation_index(rates, min_gain, patience) is not None or best is not ordered[-1]
    return knee, saturated


def batch_sweep(measure: Callable[[int], PointResult], batches: BatchRange) -> Iterator[PointResult]:
    """Measure one series' batches in order, stopping by the rule of the module."""
    measured: list[float] = []
    for batch in batches.explicit or _doublings(batches.first, batches.last):
        result = measure(batch)
        yield result
        if isinstance(result, SkippedPoint):
            if result.out_of_memory or not batches.explicit:
                return  # a larger batch needs more memory still, and a skipped doubling ends the curve
            continue
        measured.append(result.samples_per_s)
        if not batches.explicit and saturation_index(measured, batches.min_gain, batches.patience) is not None:
            return


def _doublings(first: int, last: int) -> Iterator[int]:
    batch = first
    while batch <= last:
        yield batch
        batch *= 2
