"""Sharded checkpoints with torch.distributed.checkpoint, written atomically.

Every rank writes its own shards into a temporary folder; after a barrier rank 0 renames
it into place, so a folder named `step-N` is always complete. DCP stores shards with their
global offsets, so a checkpoint loads into any world size, including one unsharded process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn


def save_checkpoint(model: nn.Module, root: Path, step: int) -> Path:
    target = root / f"step-{step}"
    staging = root / f".step-{step}.partial"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    dcp.save(model.state_dict(), checkpoint_id=str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    dist.barrier()
    return target


def latest_checkpoint(root: Path) -> Path | None:
    steps = [(int(p.name.split("-")[1]), p) for p in root.glob("step-*") if p.is_dir()]
    return max(steps)[1] if steps else None


def load_unsharded(model: nn.Module, checkpoint: Path) -> nn.Module:
    """Load a sharded checkpoint into a plain model in this one process."""
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state)
    return model
