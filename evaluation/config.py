"""Configuration of evaluation on the held-out days."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CRITEO_SLICE_FEATURE = "C17"


@dataclass(frozen=True)
class EvaluationConfig:
    batch_size: int = 8192
    """examples per scoring batch"""
    # Windowed NE during training covers this many most recent samples.
    ne_window: int = 100_000
    """samples in the windowed training NE"""
    # Every this many steps, NE on the first `heldout_batches` batches of the eval days (0: off;
    # `heldout_batches = 0`: all of them).
    heldout_every_steps: int = 0
    """every this many steps, NE on a sample of the held-out days during training; `0`: off (`demo.toml` sets 50)"""
    heldout_batches: int = 4
    """batches of the held-out days in that sample; `0`: all of them"""
    # Held-out NE also at the end of every epoch (what early stopping watches).
    heldout_every_epoch: bool = False
    """held-out NE also at the end of every epoch (what the tuner's early stopping watches)"""
    # NE is also reported per value of this categorical feature, for its most frequent values
    # (a Parquet source without a C17 column: its first id column unless named here).
    slice_feature: str = CRITEO_SLICE_FEATURE
    """NE is also reported per value of this categorical feature (C1..C26, or a `parquet` source's id column: its first one when
    left at `C17`); for a `multi_hot` feature, by the first id of the bag"""
    slice_top_k: int = 5
    """for its this many most frequent values"""
    # A new model becomes champion only if its NE is lower than the champion's by this
    # fraction, on the same evaluation days (0.001: at least 0.1 % better).
    promotion_margin: float = 0.0
    """a new model becomes champion only if its NE beats the champion's by this fraction on the same days (0.001: 0.1 %); in [0,
    1)"""
    # No model is promoted, the first included, unless its NE is below the constant click
    # rate's and the logistic regression's on the same days by this fraction (0: just below).
    reference_margin: float = 0.0
    """no model is promoted, the first included, unless its NE is below the constant click rate's and the logistic regression's
    on the same rows by this fraction; in [0, 1). A refused model is still registered, tagged `promotion.decision = refused`
    with the reason"""
    # ... and its calibration (Σ predictions / Σ labels) is inside [calibration_min,
    # calibration_max]. A predicted CTR scales bids and mixes with other models' scores, so
    # 10 % off is the usual alarm; a sound model reads within a few % (the demo's 0.964, and
    # 1.004 calibrated), and sampling noise in the click rate of 2,000 held-out rows is about
    # 4 % (one sd).
    calibration_min: float = 0.9
    """… and its calibration (Σ predictions / Σ labels) is at least this; in (0, 1]"""
    calibration_max: float = 1.1
    """… and at most this; ≥ 1"""
    # The logistic-regression reference fits on at most about this many training rows, a
    # sample picked by a hash of each row (it holds them in memory: ~1.7 GB a million); 0: all.
    reference_max_rows: int = 2_000_000
    """the logistic-regression reference fits on at most about this many training rows, a sample picked by a hash of each row (it
    holds them in memory, about 1.7 GB a million); `0`: all"""
    # How the reference chooses its L2: 0 (auto) cross-validates on few rows, where one slice
    # of 10 % is too noisy to choose by (training/reference.py: CV_BELOW_ROWS, CV_FOLDS).
    reference_folds: int = 0
    """how the logistic-regression reference chooses its L2 strength: `0`, by 5-fold cross-validation below 200,000 training
    rows (one slice of 10 % is too noisy to choose by on few rows) and on one hashed 10 % slice above; `1`, always on the slice
    (about a third of the CPU); `k` > 1, always by `k`-fold cross-validation"""
    # Off: only the constant click rate gates (the logistic regression is still reported).
    # For data too small for any DLRM to beat a fitted logistic regression, where the run
    # exists to exercise the registry rather than to ship a model.
    gate_on_logistic_regression: bool = True
    """whether the logistic regression gates promotion (the constant click rate always does); off for data too small for any DLRM
    to beat it, where a run exists to exercise the registry"""
    # The served probabilities are calibrated (evaluation/calibration.py): "platt" (a logistic
    # regression on the model's logit), "isotonic", or "none". The calibrator is fitted on
    # `calibration_percent` % of the training rows, chosen by a hash of each row, that the
    # model does not train on (never the evaluation days); the report, the gate and the
    # registered model all use the calibrated probabilities.
    calibration: Literal["platt", "isotonic", "none"] = "platt"
    """how the served probabilities are calibrated: `"platt"` (a logistic regression on the model's logit), `"isotonic"` (a
    monotone step function), or `"none"`; fitted on held-out training rows, never the evaluation days; the report, the gate
    and the registered model use the calibrated probabilities ([calibration.md](calibration.md))"""
    calibration_percent: float = 10.0
    """the share of the training rows, chosen by a hash of each row, held out of training to fit the calibrator and, with
    `training.epochs = "auto"`, to choose the run's length (also when `calibration = "none"`); in (0, 100)"""
    # ... of the newest this many days the model has seen (a night continuing a champion
    # adds its lineage's earlier days: more rows, a steadier fit; fewer follow a drift faster).
    calibration_days: int = 7
    """the calibrator is fitted on the held-out rows of the newest this many days the model has seen (a night continuing a
    champion counts its lineage's earlier days): more rows give a steadier fit, fewer follow a drift sooner"""

    def __post_init__(self) -> None:
        if self.heldout_every_steps < 0 or self.heldout_batches < 0:
            raise ValueError("heldout_every_steps: must be ≥ 0, with heldout_batches ≥ 0 (0: all)")
        if not _COLUMN_NAME.match(self.slice_feature):
            raise ValueError(f"slice_feature: must name a categorical feature, got {self.slice_feature!r}")
        if self.slice_top_k < 1:
            raise ValueError(f"slice_top_k: must be at least 1, got {self.slice_top_k}")
        if not 0.0 <= self.promotion_margin < 1.0:
            raise ValueError(f"promotion_margin: must be in [0, 1), got {self.promotion_margin}")
        if self.reference_max_rows < 0:
            raise ValueError(f"reference_max_rows: must be ≥ 0 (0: all rows), got {self.reference_max_rows}")
        if self.reference_folds < 0:
            raise ValueError(f"reference_folds: must be ≥ 0 (0: chosen by the rows, 1: one slice), got {self.reference_folds}")
        if not 0.0 <= self.reference_margin < 1.0:
            raise ValueError(f"reference_margin: must be in [0, 1), got {self.reference_margin}")
        if not 0.0 < self.calibration_min <= 1.0:  # the band holds 1.0, calibrated
            raise ValueError(f"calibration_min: must be in (0, 1], got {self.calibration_min}")
        if not self.calibration_max >= 1.0:
            raise ValueError(f"calibration_max: must be at least 1, got {self.calibration_max}")
        if self.calibration != "none" and not 0.0 < self.calibration_percent < 100.0:
            raise ValueError(f"calibration_percent: must be in (0, 100), got {self.calibration_percent}")
        if self.calibration_days < 1:
            raise ValueError(f"calibration_days: must be at least 1, got {self.calibration_days}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be positive, got {self.batch_size}")
        if self.ne_window < 1:
            raise ValueError(f"ne_window: must be positive, got {self.ne_window}")
