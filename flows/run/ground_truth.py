"""The generated days' ground truth for a command: built once a process
(`ingestion.synthetic.shared_ground_truth`), its calibrated bias kept in the user's cache
(`training/user_cache.py`) so that the next command, night or flow run that generates days of
the same config skips the pilot sample that calibrates it (0.35 s of CPU for the tiny config)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ingestion.config import SyntheticConfig
from ingestion.synthetic import GroundTruth, shared_ground_truth
from training.user_cache import user_cache


def ground_truth_cache() -> Path:
    """Where the calibrated biases are kept."""
    return user_cache() / "ground-truth"


def ground_truth(synthetic: SyntheticConfig, multi_hot: Sequence[str] = ()) -> GroundTruth:
    """`synthetic`'s ground truth, with `multi_hot`'s features drawn as bags of ids."""
    return shared_ground_truth(synthetic, tuple(multi_hot), kept_in=ground_truth_cache())
