"""String ids → 64-bit integers: FNV-1a over each value's UTF-8 bytes.

The one hash of text ids, at ingestion (the warehouse stores the hash) and at serving (the
registered model hashes its input alike). It imports numpy and pyarrow only: the served
model bundles this file. FNV-1a is fixed by its definition, so a warehouse written by one
release and a model served by another agree.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FNV_OFFSET_BASIS = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)


def hash_strings(values: pa.Array) -> pa.Array:
    """A string (or binary) array → int64 hashes; nulls stay null."""
    binary = pc.cast(values, pa.large_binary())
    if isinstance(binary, pa.ChunkedArray):
        binary = binary.combine_chunks()
    _, offsets_buffer, data_buffer = binary.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int64)[binary.offset : binary.offset + len(binary) + 1]
    data = np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    hashes = fnv1a(data, offsets)
    return pa.array(hashes.view(np.int64), pa.int64(), mask=binary.is_null().to_numpy(zero_copy_only=False))


def fnv1a(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[n] uint64: FNV-1a of each data[offsets[i]:offsets[i+1]].

    Vectorised by byte position over the values sorted longest first, so the values still
    going at position p are a prefix: one slice per position, not one loop per value.
    """
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")
    starts, remaining = offsets[:-1][order], lengths[order]
    hashes = np.full(len(order), FNV_OFFSET_BASIS, np.uint64)
    with np.errstate(over="ignore"):
        for position in range(int(remaining.max()) if len(remaining) else 0):
            live = int(np.searchsorted(-remaining, -position, side="left"))  # remaining > position
            hashes[:live] ^= data[starts[:live] + position].astype(np.uint64)
            hashes[:live] *= FNV_PRIME
    out = np.empty_like(hashes)
    out[order] = hashes
    return out


def hash_texts(texts: list[str]) -> np.ndarray:
    """[n] int64: the hashes of Python strings (serving)."""
    return hash_strings(pa.array(texts, pa.string())).to_numpy(zero_copy_only=False).astype(np.int64)
