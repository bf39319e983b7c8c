"""Sharded checkpoints of the whole training state, written atomically.

A checkpoint holds the sharded model and optimizer state (torch.distributed.checkpoint),
the training position (step, epoch, batch within the epoch) and, per rank, its RNG states
and the count and fingerprint of the rows it has trained. Every rank writes its shards into
a staging folder; after a barrier rank 0 renames it to `step-N`, so a folder with that name
is always complete, then prunes all but the newest K.

DCP stores shards with their global offsets, so a checkpoint loads into any world size:
into 1 process from 2, into 2 from 1, and into a plain unsharded model (`load_unsharded`).

In delta mode (`training.checkpoint_mode = "delta"`, loop/delta_checkpoint.py) a checkpoint
may hold only the rows changed since its parent; every function here reads a checkpoint
through its chain, so a delta loads, exports and warm-starts as a full one does. A checkpoint
whose chain is broken is never the latest: `refused_checkpoints` (loop/checkpoint_chain.py) says why.
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

from training.loop.checkpoint_chain import (
    META,
    BrokenChain,
    chain_of,
    complete_checkpoints,
    read_meta,
    step_of,
)
from training.loop.delta_checkpoint import RowSignatures, apply_rows, save_delta


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


# What this process's next delta builds on: the row signatures of the checkpoint it last wrote
# or resumed from in delta mode. One model a process (a training worker). `_base`: those of
# the chain's start in this process (the checkpoint it resumed or warm-started from, or its
# newest full one), which a delta falls back to when a run that went back to an earlier
# epoch drops its later checkpoints: 8 more bytes a row, while the two differ.
_parent: RowSignatures | None = None
_base: RowSignatures | None = None


def save_checkpoint(
    model: nn.Module, optimizer: Optimizer, root: Path, position: TrainPosition, ledger: RowLedger, keep: int,
    full_every: int = 0,
) -> Path:
    """Write `root/step-N`, then prune all but the newest `keep` (and what their chains need).

    `full_every` > 0 (delta mode): a delta on the last checkpoint this process wrote or
    resumed from, unless that chain already has `full_every` links or is gone: then a full
    one. 0: a full checkpoint that leaves the delta parent as it was (a best-epoch copy)."""
    global _parent, _base
    rank = dist.get_rank()
    target = root / f"step-{position.step}"
    staging = root / f".step-{position.step}.partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    parent = _delta_parent(full_every)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if parent is not None:
        meta, signatures = save_delta(state, staging, parent)
    else:
        dcp.save(state, checkpoint_id=str(staging))
        meta = {"kind": "full", "links": 1}
        signatures = RowSignatures.of(state, target, 1).signatures if full_every else {}
    torch.save({"rng": _rng_state(), "ledger": asdict(ledger)}, staging / f"rank-{rank:05d}.pt")
    dist.barrier()  # every rank's files are written
    if rank == 0:
        files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
        meta = {"position": asdict(position), "world_size": dist.get_world_size(), **meta, "files": files}
        (staging / META).write_text(json.dumps(meta))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        prune_checkpoints(root, keep)
        if full_every:
            written = sum(meta["files"].values())
            on = f" on {parent.checkpoint} (link {meta['links']} of at most {full_every})" if parent else ""
            print(f"[train] checkpoint {target.name}: {meta['kind']}{on}, {written / 2**20:,.1f} MiB", flush=True)
    dist.barrier()
    if full_every:
        _parent = RowSignatures(target.resolve(), meta["links"], signatures)
        if meta["kind"] == "full":
            _base = _parent
    return target


def _delta_parent(full_every: int) -> RowSignatures | None:
    """The checkpoint the next one is a delta on, or None for a full one: rank 0's view
    (the folder is shared), so that every rank writes the same kind. Every rank waits here
    for rank 0 to have made the staging folder."""
    if not full_every:
        dist.barrier()  # the staging folder is made
        return None
    usable = _parent is not None and _parent.links < full_every
    if usable and dist.get_rank() == 0:
        usable = (_parent.checkpoint / META).is_file()  # type: ignore[union-attr]
    decided = [usable]
    dist.broadcast_object_list(decided, src=0)
    return _parent if decided[0] else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints and the links their chains need."""
    complete = sorted(complete_checkpoints(root), key=step_of)
    needed: set[Path] = set()
    for kept in complete[-keep:]:
        try:
            needed.update(link.resolve() for link in chain_of(kept))
        except BrokenChain:
            needed.add(kept.resolve())
    for old in complete:
        if old.resolve() not in needed:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(model: nn.Module, optimizer: Optimizer | None, checkpoint: Path,
                    same_run: bool = True, track: bool = False) -> tuple[TrainPosition, RowLedger]:  # fmt: skip
    """Load into a sharded model (any world size), through the checkpoint's chain. RNG and
    row ledger come back only for the same run (`same_run`: a resume, not a warm start) at
    an unchanged world size; otherwise each rank starts a fresh ledger. `track` (delta mode):
    the next checkpoint may be a delta on this one (at an unchanged world size)."""
    global _parent, _base
    state: dict = {"model": model.state_dict()}
    if optimizer is not None:
        # Optimizer state (Adam's moments) is created lazily; DCP loads in place, so it must
        # exist first. A dummy step on zero gradients creates it and moves no parameter.
        optimizer.init_state()  # type: ignore[attr-defined]
        optimizer.zero_grad(set_to_none=True)
        state["optimizer"] = optimizer.state_dict()
    chain = chain_of(checkpoint)
    dcp.load(state, checkpoint_id=str(chain[0]))
    for link in chain[1:]:
        apply_rows(state, link)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    meta = read_meta(checkpoint)
    if track and optimizer is not None and meta["world_size"] == dist.get_world_size():
        live = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        _parent = _base = RowSignatures.of(live, checkpoint.resolve(), len(chain))
    elif track:
        _parent = _base = None  # another layout: the next checkpoint is a full one
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


def drop_checkpoints_after(root: Path, step: int) -> None:
    """Remove the checkpoints past `step` (rank 0, then every rank waits): a run that went
    back to an earlier model must neither resume from them nor prune its final checkpoint
    as the oldest."""
    global _parent, _base
    later = [p for p in complete_checkpoints(root) if step_of(p) > step]
    dropped = {p.resolve() for p in later}
    if _base is not None and _base.checkpoint in dropped:
        _base = None
    if _parent is not None and _parent.checkpoint in dropped:
        _parent = _base  # the next delta is on the chain's start, with every row changed since
    dist.barrier()
    if dist.get_rank() == 0:
        for checkpoint in later:
            shutil.rmtree(checkpoint, ignore_errors=True)
    dist.barrier()


def load_unsharded(model: nn.Module, checkpoint: Path) -> nn.Module:
    """Load a sharded checkpoint's model into a plain model in this one process."""
    state = {"model": model.state_dict()}
    chain = chain_of(checkpoint)
    with warnings.catch_warnings():  # one process on purpose: DCP warns that no process group is up
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(chain[0]), no_dist=True)
        for link in chain[1:]:
            apply_rows(state, link, no_dist=True)
    model.load_state_dict(state["model"])
    return model


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
