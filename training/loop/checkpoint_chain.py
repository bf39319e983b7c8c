"""Which checkpoints a run folder holds and which of them load: the chain files only (each
checkpoint's `meta.json`, the files it lists), no tensor read.

A checkpoint of full mode is a chain of one; a delta names its parent, back to a full one
(loop/delta_checkpoint.py). The newest whose whole chain is on disk is the one a resume
loads. No torch here: the launcher and a `dlrm` command choose the checkpoint before any
process that trains has started, and pay nothing for it at their start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

META = "meta.json"


class BrokenChain(Exception):
    """A checkpoint whose chain cannot be loaded: a link missing, incomplete or cut short."""


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META).read_text())


def chain_of(checkpoint: Path) -> list[Path]:
    """The checkpoints to load, oldest (the full one) first; BrokenChain names what is wrong."""
    chain, link = [], checkpoint
    while True:
        if not (link / META).is_file():
            raise BrokenChain(f"{link} is missing or incomplete (no {META})")
        meta = read_meta(link)
        for name, size in meta.get("files", {}).items():
            found = link / name
            if not found.is_file() or found.stat().st_size != size:
                raise BrokenChain(f"{found} is missing or not the {size:,} bytes written")
        chain.append(link)
        if meta.get("kind", "full") == "full":
            return chain[::-1]
        link = Path(os.path.normpath(link.parent / meta["parent"]))
        if link in chain:
            raise BrokenChain(f"{checkpoint}'s chain loops at {link}")


def complete_checkpoints(root: Path) -> list[Path]:
    """The checkpoint folders under `root` whose metadata was written (in no order)."""
    return [p for p in root.glob("step-*") if p.is_dir() and (p / META).is_file()] if root.is_dir() else []


def step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose chain loads (every checkpoint of full mode)."""
    for checkpoint in sorted(complete_checkpoints(root), key=step_of, reverse=True):
        try:
            chain_of(checkpoint)
        except BrokenChain:
            continue
        return checkpoint
    return None


def refused_checkpoints(root: Path) -> list[str]:
    """Why each checkpoint newer than `latest_checkpoint(root)` cannot be loaded, a line each."""
    refused = []
    for checkpoint in sorted(complete_checkpoints(root), key=step_of, reverse=True):
        try:
            chain_of(checkpoint)
        except BrokenChain as why:
            refused.append(f"checkpoint {checkpoint} is refused: its chain is broken: {why}")
            continue
        break
    return refused
