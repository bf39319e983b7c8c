"""How many of a day's ids have an embedding row of their own in a trained model: how well a
categorical mode keeps up with ids that come and go (docs/managed-ids.md).

- managed: the id is resident in the served remapping;
- vocab: the id is in the served vocabulary;
- hash: the id was trained and no other trained id hashes to its row.

Counted over the day's occurrences (an id as often as it occurs) and over its distinct ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ingestion.warehouse import partition_dir
from training.serving.export import served_ids


@dataclass(frozen=True)
class OwnRowShare:
    occurrences: float  # of the day's id occurrences, the share whose id has its own row
    distinct: float  # of the day's distinct ids, the share with their own row


def day_ids(warehouse: Path, day: int, features: Sequence[str]) -> dict[str, np.ndarray]:
    """Each feature's raw ids on `day`, as logged (missing values left out)."""
    table = pq.read_table(partition_dir(warehouse, day), columns=list(features), partitioning=None)
    return {feature: table[feature].drop_null().to_numpy().astype(np.int64) for feature in features}


def own_row_share(mode: str, warehouse: Path, serving: Path, buckets: Mapping[str, int], trained_days: Sequence[int],
                  day: int) -> OwnRowShare:  # fmt: skip
    """The share of `day`'s ids with a row of their own in the model served from `serving`
    (managed and vocab modes: `served_ids`), trained on `trained_days` of `warehouse` (hash
    mode: which ids share a row, 1 + id mod buckets as preprocessing hashes). `buckets`: each
    feature's hash buckets."""
    features = list(buckets)
    ids = day_ids(warehouse, day, features)
    # hash mode: every trained day's ids, each day read once
    trained_days_ids = [day_ids(warehouse, d, features) for d in trained_days] if mode == "hash" else []
    owned_occurrences = owned_distinct = total_occurrences = total_distinct = 0
    for feature in features:
        values = ids[feature]
        distinct = np.unique(values)
        if mode != "hash":
            own = np.isin(distinct, served_ids(serving, feature))
        else:
            trained = np.unique(np.concatenate([trained_ids[feature] for trained_ids in trained_days_ids]))
            rows, sharing = np.unique(1 + trained % buckets[feature], return_counts=True)
            alone = rows[sharing == 1]
            own = np.isin(distinct, trained) & np.isin(1 + distinct % buckets[feature], alone)
        owned_distinct += int(own.sum())
        total_distinct += len(distinct)
        owned_occurrences += int(np.isin(values, distinct[own]).sum())
        total_occurrences += len(values)
    return OwnRowShare(owned_occurrences / max(total_occurrences, 1), owned_distinct / max(total_distinct, 1))
