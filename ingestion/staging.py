"""Staging folders: where a partition, a day's features or a holdout split is written before
it is renamed into place, so that readers never see half of one.

Each staging folder records its owner (host and process id). A process killed outright
(SIGKILL, a lost machine) runs no `finally` and leaves its staging behind, so every writer
first removes the staging that a process of this host left and that no longer runs. Staging
of another host (a shared folder) is left to that host: its processes cannot be seen here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

OWNER_FILE = "_owner.json"
# A folder without an owner file (cut between mkdir and the owner's write, or written by an
# older version) is stale once nothing has touched it for this long.
UNOWNED_STALE_S = 3600.0


def new_staging(parent: Path, name: str, sweep: str = "") -> Path:
    """A new, empty staging folder `parent/<name>-<id>`, owned by this process, after removing
    the stale staging under `parent` whose names start with `sweep` (all: `parent` holds
    staging only)."""
    remove_stale(parent, sweep)
    folder = parent / f"{name}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def release(folder: Path) -> Path:
    """The staging folder without its owner file: what is renamed into place."""
    (folder / OWNER_FILE).unlink(missing_ok=True)
    return folder


def remove_stale(parent: Path, prefix: str = "") -> list[Path]:
    """Remove the staging folders under `parent` (named `prefix…-<id>`) that a process of this
    host left and that no longer runs; returns them."""
    if not parent.is_dir():
        return []
    removed = []
    for folder in sorted(p for p in parent.iterdir() if p.is_dir() and p.name.startswith(prefix) and _is_staging(p)):
        if _stale(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _is_staging(folder: Path) -> bool:
    # `<name>-<8 hex>`, as `new_staging` names them
    tail = folder.name.rsplit("-", 1)[-1]
    return len(tail) == 8 and all(c in "0123456789abcdef" for c in tail)


def _stale(folder: Path) -> bool:
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime > UNOWNED_STALE_S
        except FileNotFoundError:
            return False  # renamed into place or removed meanwhile
    except (OSError, ValueError):
        return False
    if owner.get("host") != socket.gethostname():
        return False
    return not _running(int(owner.get("pid", 0)))


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
