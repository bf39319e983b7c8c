"""A new Prefect home's database starts as a copy of the one a first server's start-up made
(flows/stages/prefect_database.py): the template is that database, kept before the server
answered; a server on a later new home opens the copy and works; PostgreSQL, an existing
database and a used home are left to Prefect."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import httpx
import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings
from process_tree import alive, descendants

from flows.stages.local_server import _start, prefect_api, server_answers, temporary_server
from flows.stages.prefect_database import copy_template_to, new_database, template_path
from training.launch.processes import stop_group

pytestmark = pytest.mark.slow


def _schema(path: Path) -> tuple[set[tuple[str, str, str]], list[tuple]]:
    with contextlib.closing(sqlite3.connect(path)) as database:
        objects = set(database.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
        return objects, database.execute("SELECT version_num FROM alembic_version").fetchall()


def _rows(path: Path, table: str) -> int:
    # closed here, not when collected: an open connection would keep the template's later
    # writes in its WAL file, which a copy of the database file does not carry
    with contextlib.closing(sqlite3.connect(path)) as database:
        return database.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_a_first_servers_new_database_is_kept_and_the_next_new_home_starts_from_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", raising=False)
    first, second = tmp_path / "first", tmp_path / "second"
    template = template_path()
    assert not template.exists()
    flow = _serve_on(first, monkeypatch)
    assert flow["name"] == "made-on-a-copy"
    assert template.exists(), "the first new database is kept"
    assert _schema(template) == _schema(first / "prefect.db"), "the database Prefect's start-up made"
    assert _rows(template, "block_type") == _rows(first / "prefect.db", "block_type") > 0
    assert _rows(template, "flow") == 0, "kept before the server answered a request"

    # a mark in the template: found in the next new home's database, which was copied
    with contextlib.closing(sqlite3.connect(template)) as database, database:  # closed: no WAL file is left
        database.execute("INSERT INTO configuration (id, key, value) VALUES ('mark', 'copied-from', '{}')")
    flow = _serve_on(second, monkeypatch)
    assert flow["name"] == "made-on-a-copy", "a server works on the copy"
    with contextlib.closing(sqlite3.connect(second / "prefect.db")) as database:
        assert database.execute("SELECT key FROM configuration WHERE id = 'mark'").fetchall() == [("copied-from",)]
    assert _schema(second / "prefect.db") == _schema(template)
    assert _rows(template, "flow") == 0, "the template is never served"


def _serve_on(home: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A temporary server on `home`, started as a `dlrm` command starts it: a flow made
    through its API, read back."""
    monkeypatch.setenv("PREFECT_HOME", str(home))
    server = temporary_server()
    process = _start(server, 120.0)
    try:
        api = f"{server.address}/api"
        made = httpx.post(f"{api}/flows/", json={"name": "made-on-a-copy"}, timeout=30).json()
        return httpx.get(f"{api}/flows/{made['id']}", timeout=30).json()
    finally:
        stop_group(process, grace_s=10.0)


def test_only_a_missing_sqlite_file_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client side (a persistent server's start): PostgreSQL and an existing file are
    Prefect's; a missing file is copied from the template, when there is one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    postgres = "postgresql+asyncpg://postgres@127.0.0.1:5432/prefect"
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: postgres}):
        assert new_database() is None
    missing = tmp_path / "home" / "prefect.db"
    missing.parent.mkdir()
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{missing}"}):
        assert new_database() == missing
        assert not copy_template_to(missing) and not missing.exists(), "no template yet: Prefect makes it"
        template = template_path()
        template.parent.mkdir(parents=True)
        template.write_bytes(b"the template")
        assert copy_template_to(missing) and missing.read_bytes() == b"the template"
        elsewhere = tmp_path / "no-such-folder" / "prefect.db"
        assert not copy_template_to(elsewhere) and not elsewhere.parent.exists(), "Prefect's start reports it"
        missing.write_bytes(b"a used home")
        assert new_database() is None, "an existing database is never replaced"
        copy_template_to(missing)
        assert missing.read_bytes() == b"a used home", "nor overwritten"


def test_what_a_command_runs_while_its_server_starts_runs_before_it_answers_and_a_failure_there_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefect_api(while_starting=…)`, as `dlrm run` imports its pipeline: the work runs
    while the temporary server starts (not after it answers), the block gets a server that
    answers, and work that fails stops the server it was waiting beside."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    seen: dict[str, object] = {}
    already = descendants(os.getpid())  # what the test process runs anyway (a warm-rank server)

    def while_starting() -> None:
        seen["server"] = descendants(os.getpid()) - already
        seen["answered"] = server_answers(os.environ.get("PREFECT_API_URL", "http://127.0.0.1:1/api"))

    no_server = temporary_settings(restore_defaults={PREFECT_API_URL})  # not the session's: a temporary one
    with no_server, prefect_api(while_starting=while_starting) as url:
        assert seen["server"], "the server was started before the work ran"
        assert seen["answered"] is False, "the work ran before the server answered"
        assert server_answers(url)
    assert not [pid for pid in seen["server"] if alive(pid)], "the block's end stops the server"

    def failing() -> None:
        seen["server"] = descendants(os.getpid()) - already
        raise ModuleNotFoundError("no module named 'nowhere'")

    no_server = temporary_settings(restore_defaults={PREFECT_API_URL})
    with pytest.raises(ModuleNotFoundError), no_server, prefect_api(while_starting=failing):
        pytest.fail("the block does not run when the work beside the server's start failed")
    assert seen["server"] and not [pid for pid in seen["server"] if alive(pid)], "no server is left running"
