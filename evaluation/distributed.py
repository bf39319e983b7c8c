"""Metric states on a device and across ranks: states are sums, so an all-reduce of the sums is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist

from evaluation.metrics import ETA, BinaryState


def all_reduce_state(state: BinaryState, device: torch.device | str = "cpu") -> BinaryState:
    """The sum of every rank's state, on every rank (float64 throughout)."""
    sums = torch.tensor(state.as_array(), dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    return BinaryState.from_array(sums.cpu().numpy())


def tensor_state(labels: torch.Tensor, predictions: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The sums of `metrics.binary_state` (Σw, Σw·y, Σw·p, Σw·cross entropy), by the same
    clamped definition, as a float64 tensor on the examples' device: a training step's NE
    sums add up there without making the host wait for the device. A row of weight 0 (a
    padding row) adds nothing, whatever its label."""
    y, p = labels.detach().double(), predictions.detach().double()
    w = torch.ones_like(y) if weights is None else weights.detach().double()
    clamped = p.clamp(ETA, 1.0 - ETA)
    cross_entropy = -(y * clamped.log() + (1.0 - y) * torch.log1p(-clamped))
    return torch.stack([w.sum(), (w * y).sum(), (w * p).sum(), (w * cross_entropy).sum()])


def reduced_state(sums: torch.Tensor) -> BinaryState:
    """The sum over every rank of a `tensor_state` (all-reduced in place), on the host."""
    dist.all_reduce(sums)
    return BinaryState.from_array(sums.cpu().numpy())
