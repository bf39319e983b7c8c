"""The processes below a process, read from /proc (Linux): what a stop must leave behind."""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (an ended process not yet reaped, a zombie, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def all_end(pids: Collection[int], within_s: float) -> bool:
    """Whether every process of `pids` has ended, waiting up to `within_s` seconds (a forked
    rank whose stand-in was killed outright is killed by its watcher a moment later)."""
    deadline = time.monotonic() + within_s
    while [pid for pid in pids if alive(pid)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def left_running(pids: Collection[int], within_s: float) -> list[str]:
    """The command lines of `pids` still running `within_s` seconds from now ([] once all have
    ended): a stop's processes may take a moment to end on a busy machine, but none may stay."""
    all_end(pids, within_s)
    running = []
    for pid in pids:
        if alive(pid):
            try:
                running.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300])
            except OSError:
                continue  # ended meanwhile
    return running
