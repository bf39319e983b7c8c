"""A file's identity by its bytes: what a preprocessing state is versioned by, and what names a
fitted reference (training/reference_cache.py), so the same rows in another folder are the same."""

from __future__ import annotations

import hashlib

import fsspec


def content_digest(source: str) -> tuple[str, int]:
    """sha256 (hex) and size of the file's bytes; `source` is a path or an fsspec URL."""
    digest, size = hashlib.sha256(), 0
    with fsspec.open(source, "rb") as handle:
        while chunk := handle.read(4 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
