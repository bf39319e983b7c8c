"""Differential checkpoints (`training.checkpoint_mode = "delta"`): a checkpoint that holds only
the table rows changed since the checkpoint before it (its parent), beside the dense part.

A delta checkpoint is a DCP checkpoint of every leaf of the training state that is not a
sharded table or a sharded row-wise optimizer state (the MLPs, their optimizer, counters),
plus, per rank, `rows-rank-R.pt`: for each sharded leaf, the rows of this rank's shards that
changed, as (global row numbers, the shard's global offsets in the other dimensions, the
rows' values). Rows are written in global coordinates, so a chain loads into any world size
and any plan: each loading rank takes, from every rank's file, the part of each row that
falls in its own shards.

Which rows changed: each rank keeps one 64-bit signature per row of its shards, as of the
parent (`RowSignatures`): the row's bits, each column's times an odd constant, summed
modulo 2**64. A one-column leaf (row-wise Adagrad's momentum) maps each value to its own
signature, so a change is always seen; a wider row is missed only if the changes of its
columns cancel modulo 2**64 (about 2**-64 for a changed row). The signatures cost 8 bytes a
row, the table's rows times its dim × 4 bytes being the table: an eighth of a dim-16 table.

A chain is a full checkpoint and the deltas on it, each naming its parent; loading replays
it oldest first (`load_chain`), and gives what a full checkpoint of that state would hold,
bit for bit.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.loop.checkpoint_chain import chain_of, read_meta

ROWS_FILE = "rows-rank-{rank:05d}.pt"
# Rows hashed at a time: bounds the int64 copy a signature needs to this many rows.
_ROWS_A_CHUNK = 1 << 16
_ODD = {}  # width → the columns' odd multipliers


@dataclass(frozen=True)
class RowPiece:
    """Changed rows of one shard: `rows` (global row numbers; int32 where they fit), the
    shard's global `offsets` in the dimensions after the first, and `values` ([rows, the
    shard's other sizes])."""

    rows: torch.Tensor
    offsets: tuple[int, ...]
    values: torch.Tensor

    def as_dict(self) -> dict:
        """Plain tensors and ints: what `torch.load(weights_only=True)` reads back."""
        return {"rows": self.rows, "offsets": list(self.offsets), "values": self.values}


def flat_leaves(state: dict, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested dict, by its path ("model/…weight", "optimizer/state/…")."""
    leaves: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            leaves.update(flat_leaves(value, path))
        else:
            leaves[path] = value
    return leaves


def row_paths(state: dict) -> list[str]:
    """The leaves a delta writes by rows: the sharded ones (tables and row-wise state)."""
    return sorted(path for path, value in flat_leaves(state).items() if isinstance(value, ShardedTensor))


def without(state: dict, paths: set[str], prefix: str = "") -> dict:
    """A copy of the nested dicts of `state` without the leaves at `paths` (the leaves are
    the same objects, so DCP loads into them in place)."""
    kept: dict = {}
    for key, value in state.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            kept[key] = without(value, paths, path)
        elif path not in paths:
            kept[key] = value
    return kept


def put_back(state: dict, loaded: dict) -> None:
    """Copy `loaded`'s leaves into `state` at the same places: DCP replaces the values it
    cannot load in place (ints, lists), in the dict it was given."""
    for key, value in loaded.items():
        if isinstance(value, dict):
            put_back(state[key], value)
        else:
            state[key] = value


def _shards(leaf: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """A leaf's local pieces and their global offsets: a sharded tensor's local shards, or a
    plain tensor whole (a table loaded into one process)."""
    if isinstance(leaf, ShardedTensor):
        return [(shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in leaf.local_shards()]
    return [(leaf, (0,) * leaf.dim())]


def _multipliers(width: int, device: torch.device) -> torch.Tensor:
    if width not in _ODD:
        generator = torch.Generator().manual_seed(0x5EED_0DD5 + width)
        drawn = torch.randint(-(2**62), 2**62, (width,), generator=generator, dtype=torch.int64)
        _ODD[width] = drawn * 2 + 1  # odd: invertible modulo 2**64, so one column's change always shows
    return _ODD[width].to(device)


# The integer type of each element size: a tensor's bits, to compare or hash (-0.0 is not 0.0)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def row_signatures(tensor: torch.Tensor) -> torch.Tensor:
    """One int64 per row of `tensor` (its first dimension): its bits, each column's times an
    odd constant, summed modulo 2**64."""
    rows = tensor.shape[0] if tensor.dim() else 1
    flat = tensor.detach().reshape(rows, -1)
    multipliers = _multipliers(flat.shape[1], flat.device)
    signatures = torch.empty(rows, dtype=torch.int64, device=flat.device)
    for start in range(0, rows, _ROWS_A_CHUNK):
        chunk = flat[start : start + _ROWS_A_CHUNK].contiguous().view(BITS[flat.element_size()]).to(torch.int64)
        signatures[start : start + _ROWS_A_CHUNK] = (chunk * multipliers).sum(dim=1)
    return signatures


@dataclass
class RowSignatures:
    """The row signatures of this rank's shards as `checkpoint` holds them: what a delta on
    `checkpoint` compares against. `links`: the checkpoints in its chain (1: a full one)."""

    checkpoint: Path
    links: int
    signatures: dict[tuple[str, tuple[int, ...]], torch.Tensor]

    @classmethod
    def of(cls, state: dict, checkpoint: Path, links: int) -> RowSignatures:
        leaves = flat_leaves(state)
        signatures = {(path, offsets): row_signatures(tensor)
                      for path in row_paths(state) for tensor, offsets in _shards(leaves[path])}  # fmt: skip
        return cls(checkpoint, links, signatures)

    def changed(self, state: dict) -> tuple[dict[str, list[RowPiece]], dict]:
        """The rows of `state`'s shards whose signature differs from the parent's, and the new
        signatures. A shard the parent did not have (another plan) is written whole."""
        leaves, pieces, signatures = flat_leaves(state), {}, {}
        for path in row_paths(state):
            for tensor, offsets in _shards(leaves[path]):
                now = row_signatures(tensor)
                before = self.signatures.get((path, offsets))
                changed = torch.arange(len(now), device=now.device) if before is None or before.shape != now.shape \
                    else torch.nonzero(now != before).flatten()  # fmt: skip
                signatures[(path, offsets)] = now
                if len(changed):
                    rows = changed.to(torch.int64) + offsets[0]
                    if offsets[0] + len(now) <= 2**31:  # 4 bytes a row number where they fit
                        rows = rows.to(torch.int32)
                    pieces.setdefault(path, []).append(RowPiece(rows.cpu(), offsets[1:], tensor[changed].cpu()))
        return pieces, signatures


def save_delta(state: dict, staging: Path, previous: RowSignatures) -> tuple[dict, dict]:
    """Write the delta of `state` on `previous.checkpoint` into `staging` (every rank):
    the dense part by DCP, this rank's changed rows beside it. Returns the meta entries and
    the new signatures."""
    paths = row_paths(state)
    dcp.save(without(state, set(paths)), checkpoint_id=str(staging))
    # a rank's optimizer state names only its own tables: the meta lists every rank's
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, paths)
    pieces, signatures = previous.changed(state)
    torch.save({path: [piece.as_dict() for piece in found] for path, found in pieces.items()},
               staging / ROWS_FILE.format(rank=dist.get_rank()))  # fmt: skip
    # the parent's path from the folder the delta lives in: a run folder can move
    meta = {"kind": "delta", "parent": os.path.relpath(previous.checkpoint, staging.parent),
            "row_paths": sorted(set().union(*everyone)), "links": previous.links + 1}  # fmt: skip
    return meta, signatures


def apply_rows(state: dict, link: Path, no_dist: bool = False) -> None:
    """Load one delta into `state`: its dense part (DCP, in place), then every rank's changed
    rows, each into the part of this process's shards it covers."""
    meta = read_meta(link)
    dense = without(state, set(meta["row_paths"]))
    with warnings.catch_warnings():  # one process on purpose: DCP warns that no process group is up
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(dense, checkpoint_id=str(link), no_dist=no_dist)
    put_back(state, dense)
    leaves = flat_leaves(state)
    for rows_file in sorted(link.glob("rows-rank-*.pt")):
        for path, pieces in torch.load(rows_file, weights_only=True).items():
            if path not in leaves:  # a part not asked for (a model loaded without its optimizer)
                continue
            for target, offsets in _shards(leaves[path]):
                for piece in pieces:
                    _write_piece(target, offsets, RowPiece(piece["rows"], tuple(piece["offsets"]), piece["values"]))


def _write_piece(target: torch.Tensor, offsets: tuple[int, ...], piece: RowPiece) -> None:
    """Write the part of `piece` that falls in `target` (a shard at global `offsets`)."""
    first, global_rows = offsets[0], piece.rows.to(torch.int64)
    inside = (global_rows >= first) & (global_rows < first + target.shape[0])
    if not bool(inside.any()):
        return
    rows, values = global_rows[inside] - first, piece.values[inside]
    target_index: list[Any] = [rows.to(target.device)]
    source_index: list[Any] = [slice(None)]
    for dim, (theirs, ours) in enumerate(zip(piece.offsets, offsets[1:]), start=1):
        start, stop = max(theirs, ours), min(theirs + piece.values.shape[dim], ours + target.shape[dim])
        if start >= stop:
            return
        target_index.append(slice(start - ours, stop - ours))
        source_index.append(slice(start - theirs, stop - theirs))
    with torch.no_grad():
        target[tuple(target_index)] = values[tuple(source_index)].to(target.device, target.dtype)


def whole_state(checkpoint: Path, scratch: Path) -> dict:
    """A checkpoint's whole state in this process, unsharded, through its chain (for checks
    and benches): DCP's own conversion of the full link (written to `scratch`), then the deltas."""
    chain = chain_of(checkpoint)
    whole = scratch / f"{chain[0].name}-{os.getpid()}-{len(list(scratch.glob('*.pt')))}.pt"
    dcp_to_torch_save(chain[0], whole)
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    for link in chain[1:]:
        apply_rows(state, link, no_dist=True)
    return state
