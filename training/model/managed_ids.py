"""Managed-collision ids: each categorical feature's raw ids mapped to rows of its table by
TorchRec's `MCHManagedCollisionModule`, which admits new ids and evicts stale ones.

A table of R rows holds at most R − 1 ids: its last row is shared by every id without a row
of its own (never seen, not admitted, evicted), the module's miss row. Rows change owner only
in an admission round: the ids seen since the last round are counted, those seen at least
`admit_min_count` times in it are candidates, and the policy picks the residents they replace:

- "lfu": the fewest uses since admission (a tie keeps the resident);
- "lru": the longest unseen (in rounds);
- "distance_lfu": uses divided by the rounds since last seen.

TorchRec's own quirk, kept: a resident id below the admission count in a round is not
counted in that round either.

The remapper is replicated: every process keeps the same copy and runs each round on the
same ids (the training loop gathers every process's ids of the round, in rank order), so its
rows do not depend on the world size, the tables stay ordinary TorchRec tables sharded as any
other, and a checkpoint holds one copy. It knows nothing of processes.

It reads the module's buffers `_mch_sorted_raw_ids` and `_mch_remapped_ids_mapping` and resets
its history size, which are the same in TorchRec 1.6.1 to 1.9.2 (the releases this project
installs with torch 2.11 to 2.14).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Literal

import torch
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

Policy = Literal["lfu", "lru", "distance_lfu"]
POLICIES: tuple[Policy, ...] = ("lfu", "lru", "distance_lfu")
_EMPTY = torch.iinfo(torch.int64).max  # TorchRec's id of an empty slot (never a real id)
# The module's state per row (sorted raw id, its row, and a count and/or a last-seen round)
# and per table (its output segments), in bytes.
STATE_BYTES_PER_ROW = {"lfu": 24, "lru": 24, "distance_lfu": 32}
STATE_BYTES_PER_TABLE = 8_208


def _at_least(counts: torch.Tensor, minimum: int) -> tuple[torch.Tensor, int]:
    """TorchRec's threshold filter form: which of a round's ids may be admitted."""
    return counts >= minimum, minimum


def eviction_policy(policy: Policy, admit_min_count: int) -> MCHEvictionPolicy:
    threshold = functools.partial(_at_least, minimum=admit_min_count) if admit_min_count > 1 else None
    if policy == "lfu":
        return LFU_EvictionPolicy(threshold_filtering_func=threshold)
    if policy == "lru":
        return LRU_EvictionPolicy(threshold_filtering_func=threshold)
    if policy == "distance_lfu":
        return DistanceLFU_EvictionPolicy(threshold_filtering_func=threshold)
    raise ValueError(f"managed ids: policy must be one of {list(POLICIES)}, got {policy!r}")


class ManagedIds(torch.nn.Module):
    """One managed-collision module per categorical feature, in front of its table of
    `table_sizes[feature]` rows. `remap` turns a batch's raw ids into rows; `record` keeps a
    training batch's ids for the next round; `admit` runs a round."""

    def __init__(self, table_sizes: Mapping[str, int], policy: Policy = "lfu", admit_min_count: int = 1,
                 device: torch.device | None = None) -> None:  # fmt: skip
        super().__init__()
        device = device or torch.device("cpu")
        if any(rows < 2 for rows in table_sizes.values()):
            raise ValueError(f"managed ids: a table needs at least 2 rows (one id and the miss row), got {dict(table_sizes)}")
        self.policy, self.admit_min_count = policy, admit_min_count
        self.tables = torch.nn.ModuleDict({
            feature: MCHManagedCollisionModule(zch_size=rows, device=device, eviction_interval=1, name=feature,
                                               eviction_policy=eviction_policy(policy, admit_min_count))
            for feature, rows in table_sizes.items()
        })  # fmt: skip
        self._pending: dict[str, list[torch.Tensor]] = {feature: [] for feature in table_sizes}
        self.churn = {feature: Churn() for feature in table_sizes}  # this launch's rounds, per feature
        self._stacked: tuple[torch.Tensor, ...] | None = None  # `_stack`
        self._order = {feature: i for i, feature in enumerate(table_sizes)}
        self.register_load_state_dict_post_hook(lambda module, keys: module._restack())

    def remap(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch with every raw id replaced by its row (the miss row where it has none):
        what each feature's module's `remap` gives, for all features in one search."""
        if not kjt.keys():
            return kjt
        searched, sorted_ids, rows, misses = self._stack()  # [F, N - 1], [F, N], [F, N], [F]
        keys = kjt.keys()
        if keys != list(self.tables):  # another order, or fewer features: their tables
            index = torch.tensor([self._order[feature] for feature in keys], device=sorted_ids.device)
            searched, sorted_ids, rows, misses = searched[index], sorted_ids[index], rows[index], misses[index]
        counts = kjt.length_per_key()
        values = kjt.values()
        if len(set(counts)) == 1:  # one id an example in every feature: a plain [F, B] view
            queries = values.view(len(counts), counts[0])
        else:
            queries = torch.nn.utils.rnn.pad_sequence(list(torch.split(values, counts)), batch_first=True,
                                                      padding_value=_EMPTY)  # fmt: skip
        at = torch.searchsorted(searched, queries.contiguous())
        found = sorted_ids.gather(1, at) == queries
        remapped = torch.where(found, rows.gather(1, at), misses.unsqueeze(1))
        flat = remapped.reshape(-1) if len(set(counts)) == 1 else torch.cat([r[:n] for r, n in zip(remapped, counts)])
        return KeyedJaggedTensor(keys=kjt.keys(), values=flat, lengths=kjt.lengths(), stride=kjt.stride())

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every table's sorted ids and their rows as [features, longest table] tensors
        (shorter tables padded with the empty-slot id), the ids searched (each table's last
        slot, its pinned sentinel, left out as TorchRec's `_mch_remap` does), and each table's
        miss row. Rebuilt after a round or a load."""
        if self._stacked is None:
            modules = list(self.tables.values())
            longest = max(int(m.output_size()) for m in modules)
            device = modules[0]._mch_sorted_raw_ids.device
            ids = torch.full((len(modules), longest), _EMPTY, dtype=torch.int64, device=device)
            rows = torch.zeros((len(modules), longest), dtype=torch.int64, device=device)
            for i, module in enumerate(modules):
                size = int(module.output_size())
                ids[i, :size] = module._mch_sorted_raw_ids
                rows[i, :size] = module._mch_remapped_ids_mapping
            misses = torch.tensor([self.miss_row(feature) for feature in self.tables], dtype=torch.int64, device=device)
            self._stacked = (ids[:, :-1].contiguous(), ids, rows, misses)
        return self._stacked

    def _restack(self) -> None:
        self._stacked = None

    def record(self, kjt: KeyedJaggedTensor) -> None:
        """Keep a training batch's raw ids until the next round."""
        for feature, jagged in kjt.to_dict().items():
            self._pending[feature].append(jagged.values().detach().clone())

    def pending(self) -> dict[str, torch.Tensor]:
        """The ids recorded since the last round, per feature, in the order recorded."""
        return {feature: torch.cat(parts) if parts else self._no_ids() for feature, parts in self._pending.items()}

    @torch.no_grad()
    def admit(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One admission round on `ids` (every process passes the same ones), after which the
        recorded ids are dropped. Returns each feature's rows that changed owner (new ids in
        free or evicted rows), whose embeddings the caller starts afresh."""
        changed: dict[str, torch.Tensor] = {}
        for feature, module in self.tables.items():
            values = ids.get(feature, self._no_ids()).to(self.device, torch.int64)
            if not values.numel():
                changed[feature] = self._no_ids()
                continue
            # TorchRec sizes its history once, from the first call, and drops what does not fit
            # afterwards: sized to each round's ids instead.
            module._input_history_buffer_size = -1
            module.train()
            lengths = torch.ones(values.numel(), dtype=torch.int64, device=values.device)
            before = self._residents(feature)
            module.profile({feature: JaggedTensor(values=values, lengths=lengths)})
            rows = module.evict()
            changed[feature] = rows.clone() if rows is not None else self._no_ids()
            self.churn[feature].add_round(values, before, self._residents(feature))
        self._pending = {feature: [] for feature in self.tables}
        self._stacked = None
        return changed

    @property
    def device(self) -> torch.device:
        """Where the remapper's state is (it follows `.to()`)."""
        modules = list(self.tables.values())
        return modules[0]._mch_sorted_raw_ids.device if modules else torch.device("cpu")

    def _no_ids(self) -> torch.Tensor:
        # on the remapper's device: a round's ids of a feature are concatenated and gathered
        return torch.zeros(0, dtype=torch.int64, device=self.device)

    def _residents(self, feature: str) -> torch.Tensor:
        """The ids of `feature` with a row of their own, sorted."""
        ids = self.tables[feature]._mch_sorted_raw_ids[:-1]
        return ids[ids != _EMPTY]

    def id_rows(self, feature: str) -> dict[int, int]:
        """Each resident raw id of `feature` → its row (for reports and tests)."""
        module = self.tables[feature]
        ids, rows = module._mch_sorted_raw_ids[:-1], module._mch_remapped_ids_mapping[:-1]
        resident = ids != _EMPTY
        return dict(zip(ids[resident].tolist(), rows[resident].tolist()))

    def miss_row(self, feature: str) -> int:
        """The row every id of `feature` without one of its own shares: the table's last."""
        return int(self.tables[feature].output_size()) - 1

    def state_bytes(self) -> int:
        """The remapper's state on each process."""
        sizes = {feature: int(module.output_size()) for feature, module in self.tables.items()}
        return state_bytes(sizes, self.policy)


# An admission share of ids evicted earlier in the run from which the tables are said to churn
CHURN_SHARE = 0.2


class Churn:
    """One feature's admission rounds in this launch: the ids admitted, those of them that had
    been evicted earlier (a table too small for the ids that keep coming back), and the
    distinct ids seen, which a table needs as many rows as (plus its miss row) to hold them all.
    The distinct ids are kept as a sorted tensor: 8 bytes an id."""

    def __init__(self) -> None:
        self.admitted = 0
        self.returned = 0
        self.evicted = torch.zeros(0, dtype=torch.int64)
        self.seen = torch.zeros(0, dtype=torch.int64)

    def add_round(self, ids: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> None:
        """A round on `ids` that turned residents `before` into `after` (both sorted)."""
        ids, before, after = ids.cpu(), before.cpu(), after.cpu()
        admitted = after[~torch.isin(after, before)]
        self.admitted += admitted.numel()
        self.returned += int(torch.isin(admitted, self.evicted).sum())
        self.evicted = torch.unique(torch.cat([self.evicted, before[~torch.isin(before, after)]]))
        self.seen = torch.unique(torch.cat([self.seen, ids]))

    @property
    def live_ids(self) -> int:
        return self.seen.numel()


def churn_advice(churn: Mapping[str, Churn], table_sizes: Mapping[str, int]) -> str:
    """One line when the tables churn (`CHURN_SHARE` or more of the admitted ids had been
    evicted earlier): how much, and the table size that would hold the live ids; "" otherwise."""
    admitted, returned = sum(c.admitted for c in churn.values()), sum(c.returned for c in churn.values())
    if not admitted or returned < CHURN_SHARE * admitted:
        return ""
    feature = max(churn, key=lambda f: churn[f].live_ids - table_sizes[f])
    needed = churn[feature].live_ids + 1  # and the miss row
    return (f"managed ids: {returned:,} of the {admitted:,} ids admitted ({returned / admitted:.0%}) had been evicted "
            f"earlier in this run: the tables are too small for the ids that keep coming back (feature {feature}: "
            f"{churn[feature].live_ids:,} distinct ids for {table_sizes[feature]:,} rows); tables of {needed:,} rows "
            f"(preprocess.hash_size = {needed}) would hold every id seen")  # fmt: skip


def state_bytes(table_sizes: Mapping[str, int], policy: Policy) -> int:
    """The state of a remapper in front of tables of `table_sizes` rows, on each process
    (the ids of a round waiting for it come on top, for the round's length)."""
    return sum(table_sizes.values()) * STATE_BYTES_PER_ROW[policy] + len(table_sizes) * STATE_BYTES_PER_TABLE
