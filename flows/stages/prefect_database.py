"""A new Prefect home's database, copied from the one Prefect's own start-up made first.

A Prefect server on a home without a database creates it: every migration in Prefect's
history, then its block types. On 2 cores that is 16 s before the server answers, against 5 s
on a home that has its database, and every new home pays it: a user's first `dlrm run`, `make
demo` in a new clone, each test's home. The first local server to start on a new home keeps
a snapshot of the database its start-up made, before it has answered a request, in the
user's cache (one per Prefect version and set of migrations). A server on a later new home
starts from a copy: Prefect's start-up finds it at the newest revision and only registers
its block types again, as on any home it has not seen (8 s in all).

Only a SQLite file is copied: PostgreSQL, an in-memory database and an existing file are
Prefect's own business.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from pathlib import Path

import prefect
from prefect.settings import get_current_settings

from training.user_cache import copy_if_missing, migrations_digest, user_cache

log = logging.getLogger("flows.server")
SQLITE_PREFIX = "sqlite+aiosqlite:///"


def new_database() -> Path | None:
    """The SQLite file that the Prefect server about to start will create (the settings'
    connection URL, by default `PREFECT_HOME/prefect.db`); None when it exists or the
    database is not a SQLite file."""
    url = get_current_settings().server.database.connection_url
    text = url.get_secret_value() if url is not None else ""
    if not text.startswith(SQLITE_PREFIX):
        return None
    database = text[len(SQLITE_PREFIX) :].split("?", 1)[0]
    if not database or "memory" in database:
        return None
    path = Path(database).expanduser()
    return None if path.exists() else path


def template_path() -> Path:
    """Where this Prefect version's start-up database is kept (raises RuntimeError without a
    home folder)."""
    versions = Path(prefect.__file__).parent / "server" / "database" / "_migrations" / "versions" / "sqlite"
    return user_cache() / "prefect" / f"prefect-{prefect.__version__}-{migrations_digest(versions)}.db"


def copy_template_to(path: Path) -> bool:
    """The new database `path` as a copy of the template; whether it is one. Without a
    template, or where copying fails, Prefect creates it; in a folder that does not exist,
    Prefect's start fails as it would (a mistyped path is not made here)."""
    try:
        template = template_path()
        if not template.exists() or not path.parent.is_dir():
            return False
        copy_if_missing(template, path)  # a concurrent server's copy may win: the same database
    except (OSError, RuntimeError) as error:
        log.debug("the Prefect database %s is created by Prefect (%s)", path, error)
        return False
    log.info("the Prefect database %s starts as a copy of %s", path, template)
    return True


def keep_as_template(path: Path) -> None:
    """Once a server's start-up has created `path` from nothing, and before it answers: a
    snapshot of it as the template, if there is none yet (SQLite's backup: consistent while
    the server writes). Only a database this start made: a used home's holds its runs."""
    try:
        template = template_path()
    except RuntimeError:
        return
    if not path.exists() or template.exists():
        return
    building = template.with_name(f".{template.name}.{os.getpid()}-{threading.get_ident()}.building")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(path)) as source, contextlib.closing(sqlite3.connect(building)) as copy:
            source.backup(copy)
            # WAL as Prefect keeps it: a copy that opened in another mode would have to switch,
            # which fails while the server's first connections write ("database is locked")
            copy.execute("PRAGMA journal_mode = WAL")
        os.replace(building, template)
        log.info("kept the new Prefect database as the template for new homes: %s", template)
    except (OSError, sqlite3.Error) as error:
        log.debug("no template Prefect database in %s (%s)", template.parent, error)
    finally:
        with contextlib.suppress(OSError):
            building.unlink(missing_ok=True)
