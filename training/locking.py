"""Exclusive sections across processes and hosts that share a store.

The lock lives where the store lives: a PostgreSQL advisory lock for a database URL, a
file lock beside a SQLite file (or any local path). Used to serialise promotions of a
registered model and the claiming of trials in a shared study.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path


class LockUnavailable(ValueError):
    """The store has no lock that every process can share."""


def has_shared_lock(target: str) -> bool:
    return target.startswith(("postgresql", "sqlite:///", "file:")) or "://" not in target


@contextlib.contextmanager
def exclusive(target: str, name: str) -> Iterator[None]:
    """Held by one process at a time for this (`target`, `name`)."""
    if target.startswith("postgresql"):
        with _advisory_lock(target, name):
            yield
        return
    if has_shared_lock(target):
        path = Path(target.removeprefix("sqlite:///").removeprefix("file://"))
        lock_file = path.parent / f"{path.name}.{_slug(name)}.lock"
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_file, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    raise LockUnavailable(f"{target.split('://')[0]}:// has no shared lock")


@contextlib.contextmanager
def _advisory_lock(url: str, name: str) -> Iterator[None]:
    import sqlalchemy

    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
    finally:
        engine.dispose()


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
