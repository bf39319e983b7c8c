"""A crossed pair of categorical features: one more id column, computed from the two.

A cross gives each combination of the two features' table rows a row of its own table, so
a model learns a weight for (a = u, b = v) that neither feature's own weights can express
(ingestion/crosses.py chooses which pairs). The combination is never written to the feature
files: the reader (training) and the served model (serving) compute it from the two rows
the same way, here. It imports numpy only: the served model bundles this file.

A row of the cross is (row_a · 2³² + row_b) mod `rows`. Rows of either feature are below 2³¹
(hash and vocabulary tables), so the key is exact before the modulo, and `rows` is chosen
(`crosses.cross_table_rows`) so that no combination seen often shares a row with a more
frequent one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEPARATOR = "_x_"  # a cross's name: "<first>_x_<second>", its KJT key and table


@dataclass(frozen=True)
class Cross:
    """Features `first` and `second` (one id a row each) crossed into a table of `rows` rows."""

    first: str
    second: str
    rows: int

    @property
    def name(self) -> str:
        return f"{self.first}{SEPARATOR}{self.second}"


def combined_keys(first_rows: np.ndarray, second_rows: np.ndarray) -> np.ndarray:
    """[n] int64: one exact key per combination of the two features' rows."""
    return first_rows.astype(np.int64) * np.int64(2**32) + second_rows.astype(np.int64)


def cross_rows(first_rows: np.ndarray, second_rows: np.ndarray, rows: int) -> np.ndarray:
    """[n] int64: each example's row of the cross's table."""
    return np.mod(combined_keys(first_rows, second_rows), np.int64(rows))


def crosses_from(records: Sequence[dict]) -> tuple[Cross, ...]:
    """Crosses from their JSON form (a preprocessing state, a served model's description)."""
    return tuple(Cross(str(r["first"]), str(r["second"]), int(r["rows"])) for r in records)
