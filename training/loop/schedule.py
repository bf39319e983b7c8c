"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

A pure function of the step, so a resumed run continues the schedule exactly without
saving any scheduler state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer

from training.config import TrainingConfig


def warmup_length(warmup_steps: int, warmup_fraction: float, total_steps: int) -> int:
    """Warm-up steps: the longer of a count and a fraction of the run, never past its end."""
    return min(total_steps, max(warmup_steps, round(warmup_fraction * total_steps)))


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, decay: str, min_fraction: float) -> float:
    """The factor on every base learning rate at `step` (0-based), after `warmup_steps` of
    linear warm-up (see `warmup_length`)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "none" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay {decay!r}")
    return min_fraction + (1.0 - min_fraction) * shape


class LRSchedule:
    """Scales each param group's learning rate from its configured base.

    Create it before loading a checkpoint: the base rates are read from the groups once,
    and a checkpoint restores groups at an already-scaled rate. `push` runs after every
    change; fused embedding optimizers take the new rate into their kernels there, before
    the backward pass that applies it.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, decay: str, min_fraction: float,
                 push: Callable[[], None] | None = None, warmup_fraction: float = 0.0) -> None:  # fmt: skip
        self.optimizer = optimizer
        self.base = [group["lr"] for group in optimizer.param_groups]
        self.warmup_steps, self.warmup_fraction = warmup_steps, warmup_fraction
        self.decay, self.min_fraction = decay, min_fraction
        self.push = push
        self.applied: float | None = None  # the factor the groups (and kernels) have now

    def apply(self, step: int, total_steps: int) -> float:
        """Set the rates of step `step`; only when they change (a constant rate costs a step
        nothing: pushing rates into the fused kernels walks every table group in Python)."""
        warmup = warmup_length(self.warmup_steps, self.warmup_fraction, total_steps)
        factor = lr_multiplier(step, total_steps, warmup, self.decay, self.min_fraction)
        if factor == self.applied:
            return factor
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = base * factor
        if self.push is not None:
            self.push()
        self.applied = factor
        return factor


def build_schedule(model: nn.Module, optimizer: Optimizer, config: TrainingConfig) -> LRSchedule:
    """The learning-rate schedule over both optimizers (build it before loading a checkpoint)."""
    fused = model.fused_optimizer  # type: ignore[attr-defined]
    # TorchRec's fused embedding optimizers copy their group's rate into the kernels in both
    # `zero_grad` and `step` (nothing else: the update runs inside the backward); `zero_grad`
    # skips torch's step wrapper, 1 µs against 12 (tests/unit/training/loop/
    # test_embedding_optimizer.py checks the kernels' rate at every step)
    return LRSchedule(optimizer, config.warmup_steps, config.lr_decay, config.min_lr_fraction, push=fused.zero_grad,
                      warmup_fraction=config.warmup_fraction)
