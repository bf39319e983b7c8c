"""Admission rounds of managed-collision ids (training/model/managed_ids.py) in a sharded run.

Every process keeps the same remapper. A round gathers every process's ids recorded since
the last round (in rank order), so each copy admits and evicts alike; then the rows that
changed owner start afresh: their embedding from the table's initial distribution (the same
draw whatever the sharding) and their optimizer state at zero, on whichever process holds
them (a table in host memory behind a GPU cache, `fused_uvm_caching`, has its cache written
back first and emptied after, so the cache cannot keep or write back a restarted row's old
values). Rounds run every `interval` steps, before every checkpoint (so a checkpoint holds no
ids waiting for a round, and a resumed run equals an uninterrupted one) and at the end of a
run (so the night's newest ids have rows before it serves).
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from training.model.objective import managed_ids_of
from training.model.stock_dlrm import table_name


@dataclass
class AdmissionLedger:
    """What the rounds of this launch did, for the summary; and the tables' weights and
    optimizer state they restart rows in (views of the kernels' storage, found once)."""

    rounds: int = 0
    restarted_rows: dict[str, int] = field(default_factory=dict)  # feature → rows restarted
    targets: dict[str, RestartTarget] | None = None  # table name → its weight and state
    caches: tuple[nn.Module, ...] = ()  # fbgemm kernels with a GPU cache in front of their tables

    def add(self, changed: dict[str, torch.Tensor]) -> None:
        self.rounds += 1
        for feature, rows in changed.items():
            self.restarted_rows[feature] = self.restarted_rows.get(feature, 0) + int(rows.numel())


@dataclass(frozen=True)
class RestartTarget:
    weight: torch.Tensor  # the table (a sharded tensor, or a plain one)
    states: tuple[torch.Tensor, ...]  # its per-row optimizer state


def gather_ids(pending: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every process's ids of each feature, concatenated in rank order: two collectives for
    all features (each process's counts, then its ids padded to the longest)."""
    world = dist.get_world_size()
    if world == 1:
        return pending
    features = list(pending)
    flat = torch.cat([pending[feature].to(torch.int64) for feature in features])
    counts = torch.tensor([pending[feature].numel() for feature in features], dtype=torch.int64, device=flat.device)
    every_counts = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(every_counts, counts)
    totals = [int(c.sum()) for c in every_counts]
    padded = torch.zeros(max(totals), dtype=torch.int64, device=flat.device)
    padded[: flat.numel()] = flat
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    by_rank = [torch.split(part[:total], c.tolist()) for part, total, c in zip(parts, totals, every_counts)]
    return {feature: torch.cat([ids[i] for ids in by_rank]) for i, feature in enumerate(features)}


def maybe_admit(model: nn.Module, interval: int, checkpoint_every: int, seed: int, ledger: AdmissionLedger,
                step: int, total_steps: int) -> None:  # fmt: skip
    """A round after step `step` when one is due: every `interval` steps, at a step that
    writes a checkpoint, and at the last step."""
    checkpoint = bool(checkpoint_every) and step % checkpoint_every == 0
    if step % interval == 0 or checkpoint or step == total_steps:
        admission_round(model, seed, ledger, step)


def admission_round(model: nn.Module, seed: int, ledger: AdmissionLedger, step: int) -> None:
    """One round on every process's recorded ids after step `step`; the rows that changed
    owner restart (drawn by seed and step: a resumed run draws as the uninterrupted one)."""
    managed = managed_ids_of(model)
    if managed is None:
        return
    changed = managed.admit(gather_ids(managed.pending()))
    with warnings.catch_warnings():  # TorchRec's tables are ShardedTensors, which torch calls deprecated
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        if ledger.targets is None:
            ledger.targets, ledger.caches = restart_targets(model), gpu_caches(model)
        restarting = any(rows.numel() for rows in changed.values())
        for cache in ledger.caches if restarting else ():
            cache.flush()  # the cache's newer rows to the table in host memory, which the restart writes
        restart_rows(ledger.targets, changed, seed, step)
        for cache in ledger.caches if restarting else ():
            cache.reset_cache_states()  # every row read from the table again, restarted ones included
    ledger.add(changed)


def restart_targets(model: nn.Module) -> dict[str, RestartTarget]:
    """Each embedding table's weight and per-row optimizer state, as views of the kernels'
    storage (which a launch allocates once)."""
    states = _optimizer_states(model)
    targets = {}
    for name, tensor in model.state_dict().items():
        if ".embedding_bags." in name and name.endswith(".weight"):
            table = name.split(".")[-2]
            targets[table] = RestartTarget(tensor, tuple(states.get(table, ())))
    return targets


def gpu_caches(model: nn.Module) -> tuple[nn.Module, ...]:
    """fbgemm's kernels that keep rows of host-memory tables in a GPU cache (`fused_uvm_caching`):
    a row written in the table is stale in the cache until the cache is emptied."""
    return tuple(module for module in model.modules()
                 if callable(getattr(module, "reset_cache_states", None)) and callable(getattr(module, "flush", None))
                 and isinstance(getattr(module, "lxu_cache_weights", None), torch.Tensor)
                 and module.lxu_cache_weights.numel() > 0)  # fmt: skip


def restart_rows(targets: dict[str, RestartTarget], changed: dict[str, torch.Tensor], seed: int, step: int) -> None:
    """The changed rows' embeddings drawn afresh from U(±1/√rows) (TorchRec's initial
    distribution for a table of that many rows) and their optimizer state zeroed, shard by
    shard: a shard knows its row and column offsets, and its tensor is a view of the kernel's."""
    for feature, rows in changed.items():
        if not rows.numel():
            continue
        table = table_name(feature)
        weight = targets[table].weight
        table_rows, width = weight.shape
        # the same draw on every process (Python's str hash differs from process to process)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 7_919 + zlib.crc32(feature.encode()))
        bound = 1.0 / math.sqrt(table_rows)
        fresh = torch.empty(rows.numel(), width).uniform_(-bound, bound, generator=generator)
        rows = rows.cpu()
        for tensor, row_offset, column_offset in _pieces(weight):
            _write_rows(tensor, rows, row_offset, fresh[:, column_offset : column_offset + tensor.shape[1]])
        for state in targets[table].states:
            for tensor, row_offset, _ in _pieces(state):
                _write_rows(tensor, rows, row_offset, None)


def _pieces(tensor: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
    """(local tensor, row offset, column offset) of a sharded tensor's local shards, or the
    tensor itself."""
    shards = tensor.local_shards() if hasattr(tensor, "local_shards") else None
    if shards is None:
        return [(tensor, 0, 0)]
    pieces = []
    for shard in shards:
        offsets = [int(o) for o in shard.metadata.shard_offsets]
        pieces.append((shard.tensor, offsets[0], offsets[1] if len(offsets) > 1 else 0))
    return pieces


@torch.no_grad()
def _write_rows(tensor: torch.Tensor, rows: torch.Tensor, row_offset: int, values: torch.Tensor | None) -> None:
    """Rows `rows` (global) of `tensor`, a piece starting at `row_offset`: set to `values`
    (one per row), or zeroed."""
    local = rows - row_offset
    inside = (local >= 0) & (local < tensor.shape[0])
    if not inside.any():
        return
    index = local[inside].to(tensor.device)
    if values is None:
        tensor[index] = 0
    else:
        tensor[index] = values[inside].to(tensor.device, tensor.dtype)


def _optimizer_states(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The fused embedding optimizer's per-row state (row-wise Adagrad's momentum), by the
    table it belongs to; views of the kernel's own state."""
    fused = getattr(model, "fused_optimizer", None)
    if fused is None:
        return {}
    states: dict[str, list[torch.Tensor]] = {}
    for name, state in fused.state_dict()["state"].items():  # name: "….embedding_bags.t_C1.weight"
        tensors = [tensor for tensor in state.values() if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1]
        states[name.split(".")[-2]] = tensors
    return states
