"""The Criteo display-advertising layout and the warehouse's typed Parquet schema.

A raw line: label, I1..I13 (integer counts, may be negative or empty), C1..C26 (8 hex
characters or empty), tab-separated, no header.

Multi-hot features carry a variable number of ids per example. Their raw field holds the
ids comma-separated (`0a1b2c3d,5e6f7a8b`, or empty); which features are multi-hot is part
of the warehouse's declared layout (`data.multi_hot`), and their columns are lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_COLUMNS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_COLUMNS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
RAW_COLUMNS: tuple[str, ...] = ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)
SCHEMA_VERSION = 2  # 2: multi-hot features as list columns
# Column names the pipeline's own tables and queries use: no feature may take them.
RESERVED_COLUMNS = ("label", "source_row")
MULTI_HOT_SEPARATOR = ","

# Warehouse rows: categoricals are stored as the 32-bit numbers their hex spells, not strings.
WAREHOUSE_SCHEMA = pa.schema(
    [pa.field("label", pa.int8(), nullable=False)]
    + [pa.field(name, pa.int64()) for name in DENSE_COLUMNS]
    + [pa.field(name, pa.uint32()) for name in SPARSE_COLUMNS]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("raw", pa.binary(), nullable=False),
    ]
)

# Preprocessed features: log-transformed dense floats, categorical row indices per table.
FEATURE_SCHEMA = pa.schema(
    [pa.field("label", pa.int8(), nullable=False)]
    + [pa.field(name, pa.float32(), nullable=False) for name in DENSE_COLUMNS]
    + [pa.field(name, pa.int32(), nullable=False) for name in SPARSE_COLUMNS]
)


def check_multi_hot(names: Sequence[str]) -> tuple[str, ...]:
    """The declared multi-hot features, in column order; unknown names are an error."""
    unknown = sorted(set(names) - set(SPARSE_COLUMNS))
    if unknown:
        raise ValueError(f"multi_hot: {unknown} are not categorical features (C1..C{NUM_SPARSE})")
    return tuple(name for name in SPARSE_COLUMNS if name in set(names))


def warehouse_schema(multi_hot: Sequence[str] = ()) -> pa.Schema:
    """WAREHOUSE_SCHEMA with the multi-hot features as lists of uint32 ids."""
    return _with_lists(WAREHOUSE_SCHEMA, multi_hot, pa.uint32())


def multi_hot_of(schema: pa.Schema) -> tuple[str, ...]:
    """The categorical features a warehouse or feature schema stores as lists."""
    return tuple(name for name in SPARSE_COLUMNS if pa.types.is_list(schema.field(name).type))


def _with_lists(schema: pa.Schema, multi_hot: Sequence[str], item: pa.DataType) -> pa.Schema:
    for name in check_multi_hot(multi_hot):
        index = schema.get_field_index(name)
        schema = schema.set(index, pa.field(name, pa.list_(item), nullable=schema.field(index).nullable))
    return schema


@dataclass(frozen=True)
class FeatureLayout:
    """Which warehouse columns are dense and which categorical, in column order.

    `id_types`: per categorical feature, how its ids were given: "int" (integers) or
    "string" (text, stored as a 64-bit hash of its UTF-8 bytes: ingestion/id_hash.py).
    Empty for the Criteo layout, whose ids are the 32-bit numbers their hex spells.
    """

    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    multi_hot: tuple[str, ...] = ()
    id_types: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def criteo(cls, multi_hot: Sequence[str] = ()) -> FeatureLayout:
        return cls(DENSE_COLUMNS, SPARSE_COLUMNS, check_multi_hot(multi_hot))

    @property
    def is_criteo(self) -> bool:
        return self.dense == DENSE_COLUMNS and self.sparse == SPARSE_COLUMNS and not self.id_types

    def as_dict(self) -> dict[str, Any]:
        return {"dense": list(self.dense), "sparse": list(self.sparse), "multi_hot": list(self.multi_hot),
                "id_types": dict(self.id_types)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FeatureLayout:
        return cls(tuple(data["dense"]), tuple(data["sparse"]), tuple(data.get("multi_hot", ())),
                   dict(data.get("id_types", {})))  # fmt: skip


def feature_layout(schema: pa.Schema) -> FeatureLayout:
    """The layout of a feature file: float columns are dense, integer and list columns
    categorical (their table rows), in column order."""
    dense = tuple(f.name for f in schema if pa.types.is_floating(f.type))
    sparse = tuple(f.name for f in schema if f.name != "label" and (pa.types.is_integer(f.type) or pa.types.is_list(f.type)))
    multi_hot = tuple(f.name for f in schema if pa.types.is_list(f.type))
    return FeatureLayout(dense, sparse, multi_hot)
