"""Sharded checkpoints of the whole training state, written atomically.

A checkpoint holds the sharded model and optimizer state (torch.distributed.checkpoint),
the training position (step, epoch, batch within the epoch) and, per rank, its RNG states
and the count and fingerprint of the rows it has trained. Every rank writes its shards into
a staging folder; after a barrier rank 0 renames it to `step-N`, so a folder with that name
is always complete, then prunes all but the newest K.

DCP stores shards with their global offsets, so a checkpoint loads into any world size:
into 1 process from 2, into 2 from 1, and into a plain unsharded model (`load_unsharded`).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class TrainPosition:
    """Where training stands: `step` steps done, the next batch is `batch` of `epoch`."""

    step: int
    epoch: int
    batch: int


@dataclass
class RowLedger:
    """This rank's count of trained rows and an order-free fingerprint of which rows they were."""

    rows: int = 0
    fingerprint: int = 0  # Σ row hashes, mod 2**64

    def add(self, rows: int, hash_sum: int) -> None:
        """A trained batch: its real rows' count and hash sum (`loop/batches.trained_rows`,
        worked out as the batch was read, so a step adds two integers)."""
        self.rows += rows
        self.fingerprint = (self.fingerprint + hash_sum) % 2**64


def save_checkpoint(
    model: nn.Module, optimizer: Optimizer, root: Path, position: TrainPosition, ledger: RowLedger, keep: int
) -> Path:
    rank = dist.get_rank()
    target = root / f"step-{position.step}"
    staging = root / f".step-{position.step}.partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(staging))
    torch.save({"rng": _rng_state(), "ledger": asdict(ledger)}, staging / f"rank-{rank:05d}.pt")
    if rank == 0:
        meta = {"position": asdict(position), "world_size": dist.get_world_size()}
        (staging / "meta.json").write_text(json.dumps(meta))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        for old in sorted(_complete(root), key=_step_of)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return target


def load_checkpoint(model: nn.Module, optimizer: Optimizer | None, checkpoint: Path,
                    same_run: bool = True) -> tuple[TrainPosition, RowLedger]:  # fmt: skip
    """Load into a sharded model (any world size). RNG and row ledger come back only for the
    same run (`same_run`: a resume, not a warm start) at an unchanged world size; otherwise
    each rank starts a fresh ledger."""
    state: dict = {"model": model.state_dict()}
    if optimizer is not None:
        # Optimizer state (Adam's moments) is created lazily; DCP loads in place, so it must
        # exist first. A dummy step on zero gradients creates it and moves no parameter.
        optimizer.init_state()  # type: ignore[attr-defined]
        optimizer.zero_grad(set_to_none=True)
        state["optimizer"] = optimizer.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    meta = json.loads((checkpoint / "meta.json").read_text())
    ledger = RowLedger()
    rank_file = checkpoint / f"rank-{dist.get_rank():05d}.pt"
    if same_run and meta["world_size"] == dist.get_world_size() and rank_file.is_file():
        extras = torch.load(rank_file, weights_only=False)
        _set_rng_state(extras["rng"])
        ledger = RowLedger(**extras["ledger"])
    return TrainPosition(**meta["position"]), ledger


def checkpoint_bytes(checkpoint: Path) -> int:
    """What a checkpoint holds on disk: every rank's shards, its RNG and ledger files and meta."""
    return sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())


def latest_checkpoint(root: Path) -> Path | None:
    complete = _complete(root)
    return max(complete, key=_step_of) if complete else None


def drop_checkpoints_after(root: Path, step: int) -> None:
    """Remove the checkpoints past `step` (rank 0, then every rank waits): a run that went
    back to an earlier model must neither resume from them nor prune its final checkpoint
    as the oldest."""
    if dist.get_rank() == 0:
        for later in [p for p in _complete(root) if _step_of(p) > step]:
            shutil.rmtree(later, ignore_errors=True)
    dist.barrier()


def load_unsharded(model: nn.Module, checkpoint: Path) -> nn.Module:
    """Load a sharded checkpoint's model into a plain model in this one process."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # one process on purpose: DCP warns that no process group is up
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state["model"])
    return model


def _complete(root: Path) -> list[Path]:
    return [p for p in root.glob("step-*") if p.is_dir() and (p / "meta.json").is_file()] if root.is_dir() else []


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
