"""Whether a study's best trial beats the configured values by more than the validation noise.

A study that samples enough trials finds one that looks better on its validation rows by
luck alone. So the configured values are scored on the same rows (the study's baseline), and
the tuned values replace them only if a paired bootstrap over those rows says the gain is
real: the rows are drawn again with replacement many times, both models' NE computed on each
draw, and the tuned values win only if the gain's lower bound is above zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evaluation.calibration import row_log_loss

_EPS = 1e-7


@dataclass(frozen=True)
class Gain:
    """NE(configured) − NE(tuned) on the validation rows (positive: the tuned values are
    better), with the bootstrap's interval."""

    gain: float
    low: float  # lower bound of the interval
    high: float
    rows: int
    confidence: float

    @property
    def real(self) -> bool:
        """The tuned values are better beyond the noise."""
        return self.low > 0.0

    def describe(self) -> str:
        return (f"NE gain {self.gain:+.5f}, {100 * self.confidence:.0f} % interval [{self.low:+.5f}, {self.high:+.5f}] "
                f"by a paired bootstrap over {self.rows:,} validation rows")  # fmt: skip


def paired_gain(labels: np.ndarray, configured: np.ndarray, tuned: np.ndarray, replicates: int = 1000,
                confidence: float = 0.9, seed: int = 0) -> Gain:  # fmt: skip
    """The NE gain of `tuned` over `configured` predictions of the same rows, and a two-sided
    `confidence` interval from `replicates` paired bootstrap draws (a fixed seed: the same
    rows give the same decision)."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if not (len(y) == len(configured) == len(tuned)) or len(y) == 0:
        raise ValueError(f"paired rows needed: {len(y)} labels, {len(configured)} and {len(tuned)} predictions")
    loss_configured, loss_tuned = row_log_loss(y, configured), row_log_loss(y, tuned)
    gain = _ne_gain(y, loss_configured, loss_tuned, np.ones_like(y)[None, :])[0]
    rng = np.random.default_rng(seed)
    draws = []
    for start in range(0, replicates, 100):  # 100 draws at a time bound the memory
        weights = rng.multinomial(len(y), np.full(len(y), 1.0 / len(y)), size=min(100, replicates - start))
        draws.append(_ne_gain(y, loss_configured, loss_tuned, weights.astype(np.float64)))
    spread = np.concatenate(draws)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(spread, [tail, 100 - tail])
    return Gain(float(gain), float(low), float(high), len(y), confidence)


def _ne_gain(y: np.ndarray, loss_a: np.ndarray, loss_b: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """NE(a) − NE(b) for each row of `weights` (how often each row was drawn)."""
    total = weights.sum(axis=1)
    rate = np.clip(weights @ y / total, _EPS, 1.0 - _EPS)
    entropy = -(rate * np.log(rate) + (1.0 - rate) * np.log(1.0 - rate))
    return (weights @ loss_a - weights @ loss_b) / (total * entropy)
