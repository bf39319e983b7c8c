"""Metric states across ranks: states are sums, so an all-reduce of the sums is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist

from evaluation.metrics import BinaryState


def all_reduce_state(state: BinaryState, device: torch.device | str = "cpu") -> BinaryState:
    """The sum of every rank's state, on every rank (float64 throughout)."""
    sums = torch.tensor(state.as_array(), dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    return BinaryState.from_array(sums.cpu().numpy())
