"""A run that chooses its own length (`training.epochs = "auto"`): validation after each epoch.

    epoch → NE of the validation rows → better than every epoch before? keep a copy of the
    model → `patience` epochs without a better one, or `max_epochs` done: stop, and load
    the kept copy

The validation rows are the training days' held-out rows (the calibrator's: a hash of each
row puts them aside, flows/run/rows.py), so the rows that choose the run's length are the
rows its calibrator is then fitted on, with predictions of a model that never trained on
them. The evaluation days never choose anything.

A run that continues a model (a night from the champion, or a wide part started as the
fitted regression) scores it before its first step: when no epoch of the new rows beats it,
the run keeps the model it started from and says so. The fitted regression is an optimum
already, so an epoch replaces it only by lowering the NE by more than `REGRESSION_MARGIN`:
on the few thousand held-out rows of a run that starts there (under 32,768 training rows),
smaller gains were chance (docs/run-length.md: gains of 0.03–0.5 % were followed by
evaluation days from 0.9 % better to 2.5 % worse than the regression). The scores are kept beside the
checkpoints, so a resumed run chooses as if it had never stopped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from evaluation.metrics import BinaryState, MetricError, compute_log_loss, compute_ne
from training.job import TrainJob
from training.loop.checkpoint import (
    RowLedger,
    TrainPosition,
    drop_checkpoints_after,
    load_checkpoint,
    save_checkpoint,
)
from training.loop.checkpoint_chain import latest_checkpoint
from training.loop.heldout import files_state

BEST_FOLDER = "best-validated"
SCORES_FILE = "validation.json"
# the share of the start's NE an epoch must take off to replace a fresh regression start
REGRESSION_MARGIN = 0.005


@dataclass
class EpochScores:
    """Validation NE after each epoch (`epochs` trained → NE; 0: the model a run started
    from), and the rule that stops a run that chooses its length."""

    patience: int
    max_epochs: int
    ne: dict[int, float] = field(default_factory=dict)
    # the share of the start's NE (epoch 0) that an epoch must take off to replace it
    start_margin: float = 0.0

    @property
    def best_epochs(self) -> int:
        """The epochs of the best-scored model (the earliest of equals: fewer epochs, same NE);
        the start (0) unless an epoch beats it by `start_margin`."""
        best = min(self.ne, key=lambda epochs: (self.ne[epochs], epochs))
        if best and 0 in self.ne and self.ne[best] > self.ne[0] * (1.0 - self.start_margin):
            return 0
        return best

    @property
    def trained(self) -> int:
        return max(self.ne, default=0)

    def add(self, epochs: int, ne: float) -> bool:
        """Record an epoch's score; True when it is the best so far (a NaN never is)."""
        self.ne[epochs] = ne if math.isfinite(ne) else math.inf
        return self.best_epochs == epochs

    def done(self) -> bool:
        """`patience` epochs without a better score, or the last epoch trained."""
        return self.trained >= self.max_epochs or self.trained - self.best_epochs >= self.patience

    def reason(self) -> str:
        """Why the run trained as long as it did, and which model it keeps, for people."""
        best, trained = self.best_epochs, self.trained
        scores = ", ".join(f"{e}: {ne:.5f}" for e, ne in sorted(self.ne.items()))
        if best == 0 and self.start_margin:
            kept = (f"the model it started from (no epoch of these rows lowered the validation NE by more than "
                    f"{self.start_margin:.1%}, the gain a fitted regression start asks for)")  # fmt: skip
        elif best == 0:
            kept = "the model it started from (no epoch of these rows lowered the validation NE)"
        elif best == trained:
            kept = f"epoch {best}'s model"
        else:
            kept = f"epoch {best}'s model (the {trained - best} after it did not improve)"
        stop = "max_epochs reached" if trained >= self.max_epochs else f"{self.patience} epoch(s) without improvement"
        return f"validation NE by epoch {{{scores}}}; trained {trained} epoch(s) ({stop}); kept {kept}"


class EpochValidation:
    """Scores the validation rows after each epoch, keeps the best epoch's model on disk
    (every rank its shards), and loads it back when the run is done."""

    def __init__(self, job: TrainJob, device: torch.device, resumed: bool) -> None:
        self.job, self.device = job, device
        self.root = job.checkpoint_root / BEST_FOLDER
        config = job.training
        margin = REGRESSION_MARGIN if job.starts_at_regression else 0.0
        self.scores = EpochScores(config.patience, config.max_epochs, start_margin=margin)
        self.rows = 0  # the validation rows scored
        scores_file = self.root / SCORES_FILE
        if resumed and scores_file.is_file():
            saved = json.loads(scores_file.read_text())
            self.scores.ne = {int(e): float(ne) for e, ne in saved["ne"].items()}
            self.rows = int(saved.get("rows", 0))

    @torch.no_grad()
    def score(self, model: nn.Module, optimizer: Optimizer, epochs: int, step: int, ledger: RowLedger) -> bool:
        """Score `model` after `epochs` epochs (`step` steps); keep it if it is the best so
        far. Returns True when the run should stop."""
        state: BinaryState = files_state(model, self.job.validation_files, self.job, self.device)
        ne = _score(state)
        self.rows = int(state.count)
        best = self.scores.add(epochs, ne)
        if best:
            if epochs == 0:
                # a fresh optimizer has no state until its first step; a checkpoint loads
                # into existing state (loop/checkpoint.py), so both sides must have it
                optimizer.init_state()  # type: ignore[attr-defined]
            save_checkpoint(model, optimizer, self.root, TrainPosition(step, epochs, 0), ledger, keep=1)
        if dist.get_rank() == 0:
            (self.root / SCORES_FILE).write_text(json.dumps({"ne": {str(e): v for e, v in self.scores.ne.items()},
                                                               "rows": self.rows}))  # fmt: skip
            mark = " (best so far)" if best else f" (best: epoch {self.scores.best_epochs})"
            print(f"[train] epoch {epochs}: validation NE {ne:.6f} on {int(state.count):,} held-out rows{mark}",
                  flush=True)  # fmt: skip
        return self.scores.done()

    def restore_best(self, model: nn.Module, optimizer: Optimizer) -> tuple[TrainPosition, RowLedger] | None:
        """Load the best epoch's model, optimizer and row ledger when the run went past it;
        None when the last epoch is the best (the model in memory is already it)."""
        if self.scores.best_epochs == self.scores.trained:
            return None
        best = latest_checkpoint(self.root)
        assert best is not None, f"no checkpoint of the best epoch under {self.root}"
        position, ledger = load_checkpoint(model, optimizer, best)
        drop_checkpoints_after(self.job.checkpoint_root, position.step)
        return position, ledger

    def summary(self) -> dict:
        """The summary's figures: epochs trained and kept, NE by epoch, and why."""
        ne = self.scores.ne
        return {"epochs_trained": self.scores.trained, "epochs_kept": self.scores.best_epochs,
                "validation_ne": {str(e): (v if math.isfinite(v) else None) for e, v in sorted(ne.items())},
                "validation_rows": self.rows, "run_length": self.scores.reason()}  # fmt: skip


def _score(state: BinaryState) -> float:
    """NE; the log loss where NE is undefined (one label only), which orders models alike
    on a fixed set of rows; NaN on no rows."""
    try:
        return compute_ne(state)
    except MetricError:
        try:
            return compute_log_loss(state)
        except MetricError:
            return float("nan")
