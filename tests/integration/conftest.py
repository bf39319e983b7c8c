"""Integration fixtures: one temporary Prefect server and one warm-rank server for the session.

Training jobs start from the warm-rank server (training/launch/warm_ranks.py: ranks forked
from a process that imported the trainer once). The modules and tests marked `launcher` test
the launcher itself (stops, failure reports, the pipeline's killed rank): their jobs keep
torchrun, whose ranks the server forks (`DLRM_WARM_RANKS_UNDER_TORCHRUN`), as a launch across
hosts (the simulated hosts, the Slurm nodes) always does. Those marked `torchrun` launch as a
deployment does, each rank a new interpreter (the GPU tests; test_warm_ranks.py trains the
same job under plain torchrun too)."""

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import create_database, databases_named, drop_database, postgres_answers

from training.launch.warm_ranks import ENVIRONMENT_KEY, UNDER_TORCHRUN_KEY, start_server, stop_server

# The session servers' PostgreSQL databases: the prefix and the test process's id
SESSION_DATABASE_PREFIX = "dlrm_tests_prefect_"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's temporary Prefect server, started as a `dlrm` command starts its own;
    yields its API URL, for in-process flows and `dlrm` subprocesses (each would otherwise
    start a temporary server of its own: ~15 s).

    Its database is PostgreSQL's when the local server answers (as docker-compose.yml runs
    Prefect), a new database for this test process: a whole suite's flow runs on one SQLite
    file stalled a run for a minute now and then, a write waiting out the 60 s busy timeout
    Prefect sets ("database is locked", Prefect's own SQLite issue). Without PostgreSQL, a
    SQLite file of its own, copied from the template (flows/stages/prefect_database.py)."""
    from prefect.context import refresh_global_settings_context

    from flows.stages.local_server import prefect_api, temporary_server

    with _session_database(tmp_path_factory) as database_url:
        server = temporary_server()
        server = dataclasses.replace(server, env={**server.env, "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url})
        with prefect_api(server) as url:
            refresh_global_settings_context()  # threads a test starts read the process-wide settings
            yield url
        refresh_global_settings_context()


@contextlib.contextmanager
def _session_database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A new PostgreSQL database (dropped at the end, and any an ended test process left
    behind), or a SQLite file when no PostgreSQL server answers."""
    if not postgres_answers():
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('prefect-server') / 'prefect.db'}"
        return
    for name in databases_named(SESSION_DATABASE_PREFIX):
        if not _process_alive(int(name.removeprefix(SESSION_DATABASE_PREFIX))):
            drop_database(name)
    name = f"{SESSION_DATABASE_PREFIX}{os.getpid()}"
    drop_database(name)
    url = create_database(name).replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        yield url
    finally:
        drop_database(name)


def _process_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="session")
def warm_rank_server() -> Iterator[Path]:
    """This test process's warm-rank server; yields its socket (short: a Unix socket's path
    has a limit of about 100 bytes)."""
    socket_path = Path(tempfile.mkdtemp(prefix="warm-ranks-")) / "server.sock"
    server = start_server(socket_path)
    yield socket_path
    stop_server(server)
    socket_path.unlink(missing_ok=True)
    socket_path.parent.rmdir()


@pytest.fixture(scope="module", autouse=True)
def _warm_ranks_for_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """`DLRM_WARM_RANKS` for the module (its `dlrm` subprocesses too), unless it is marked
    `torchrun`; a module marked `launcher` keeps torchrun as well."""
    if request.node.get_closest_marker("torchrun") is not None:
        yield
        return
    server = request.getfixturevalue("warm_rank_server")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENVIRONMENT_KEY, str(server))
        if request.node.get_closest_marker("launcher") is not None:
            patch.setenv(UNDER_TORCHRUN_KEY, "1")
        yield


@pytest.fixture(autouse=True)
def _launch_as_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked in a module that is not: `torchrun`, as deployed; `launcher`, torchrun
    with its ranks forked."""
    if request.node.get_closest_marker("torchrun") is not None:
        monkeypatch.delenv(ENVIRONMENT_KEY, raising=False)
    elif request.node.get_closest_marker("launcher") is not None:
        monkeypatch.setenv(UNDER_TORCHRUN_KEY, "1")
