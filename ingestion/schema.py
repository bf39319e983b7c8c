"""The Criteo display-advertising layout and the warehouse's typed Parquet schema.

A raw line: label, I1..I13 (integer counts, may be negative or empty), C1..C26 (8 hex
characters or empty), tab-separated, no header.
"""

from __future__ import annotations

import pyarrow as pa

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_COLUMNS: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_COLUMNS: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
RAW_COLUMNS: tuple[str, ...] = ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)
SCHEMA_VERSION = 1

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
