"""Configuration of evaluation on the held-out days."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvaluationConfig:
    batch_size: int = 8192
    # Windowed NE during training covers this many most recent samples.
    ne_window: int = 100_000

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be positive, got {self.batch_size}")
        if self.ne_window < 1:
            raise ValueError(f"ne_window: must be positive, got {self.ne_window}")
