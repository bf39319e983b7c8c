"""How many hash buckets a feature gets in hash mode (`table_rows = "ids_seen"`).

An id lands in row 1 + (id mod buckets). At twice the distinct ids, about 40 % of the ids
share their row with another (1 − e^(−1/2)), whatever the feature: harmless for a feature of
a million ids, where the partner of a frequent id is almost always a rare one, but ruinous
for a feature of three values, where it merges two of them. On generated data of 12,000 rows
(configs/tiny.toml's) merged values cost the logistic regression and the DLRM alike 4.6 % of
NE against a one-hot regression of the raw values (0.812 vs 0.774); with each value on its
own row both reach 0.774.

So a feature with few enough ids to look at gets the fewest buckets, from twice its ids
upward, at which its frequent ids (seen at least `FREQUENT` times) lose the fewest rows to a
more frequent id sharing theirs: the first count at which none does is taken at once. Rare
ids are left to share: keeping them apart too (every id counted) grew Avazu's mid-sized
tables six-fold (site_id 680 → 4,409 rows) for ids seen once or twice. The
search is bounded (`SEARCH_OPERATIONS`), so large features keep twice their ids and tables
stay small (a feature of three values gets a handful of rows, not `hash_size`).
"""

from __future__ import annotations

import numpy as np

SEARCHED_IDS = 65_536  # features with more distinct ids keep twice their ids
SEARCH_OPERATIONS = 5_000_000  # bucket counts tried × ids: under a second a feature
MOST_TRIED = 4_096  # bucket counts tried at most, however few the ids
FREQUENT = 10  # sightings from which an id's own row has something to learn


def rows_lost(ids: np.ndarray, rows: np.ndarray, buckets: int) -> int:
    """Training rows of frequent ids (seen at least `FREQUENT` times) whose id shares its
    bucket with a more frequent one (of equal ones, all but one): what the id's own row cannot
    learn. `rows[i]` is how often `ids[i]` was seen. Rare ids sharing rows lose nothing that
    counts: their own weights are mostly noise, and sharing pools them."""
    bucket = np.mod(ids, ids.dtype.type(buckets))
    order = np.lexsort((-rows, bucket))
    sorted_bucket, sorted_rows = bucket[order], rows[order]
    shares = np.zeros(len(order), dtype=bool)
    shares[1:] = sorted_bucket[1:] == sorted_bucket[:-1]  # not its bucket's most frequent id
    return int(sorted_rows[shares & (sorted_rows >= FREQUENT)].sum())


def bucket_count(ids: np.ndarray, rows: np.ndarray, most: int) -> int:
    """Buckets for a feature whose distinct `ids` (unsigned or signed integers) were seen
    `rows` times: from min(2 × ids, most) upward, the fewest that lose the fewest rows
    (`rows_lost`), stopping at the first that loses none; at most `most`."""
    least = max(1, min(most, 2 * len(ids)))
    if len(ids) == 0 or len(ids) > SEARCHED_IDS:
        return least
    tried = min(MOST_TRIED, max(1, SEARCH_OPERATIONS // len(ids)), most - least + 1)
    best, best_lost = least, None
    for buckets in range(least, least + tried):
        lost = rows_lost(ids, rows, buckets)
        if best_lost is None or lost < best_lost:
            best, best_lost = buckets, lost
        if lost == 0:
            break
    return best
