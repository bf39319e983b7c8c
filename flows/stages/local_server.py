"""The Prefect API one `dlrm` command talks to: the server `PREFECT_API_URL` names; else,
for `dlrm serve --with-server` and `dlrm server`, a persistent server with the UI; else a
temporary API-only server that the command starts and stops itself.

Prefect would start a temporary server on its own, but in the command's process group: a
Ctrl-C in the terminal then kills the server first, and the flow runs, still being
stopped, can no longer be marked (they stay "Running", the clean-up fails against a dead
API). Here every server runs in its own session (`training.launch.processes`), so the command
stops its work, marks its runs, and stops the server last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import prefect
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.stages.prefect_database import copy_template_to, new_database
from flows.stages.prefect_defaults import DASHBOARD_PORT
from training.launch.host_role import free_local_port
from training.launch.processes import start_group, stop_group

log = logging.getLogger("flows.server")
STARTUP_TIMEOUT_VARIABLE = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class ServerStartError(RuntimeError):
    """A Prefect server did not start or answer in time (shown as one line)."""


@dataclass(frozen=True)
class LocalServer:
    """How to start one kind of local Prefect server."""

    kind: Literal["temporary", "persistent"]
    command: list[str]
    env: dict[str, str]
    port: int

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def temporary_server() -> LocalServer:
    """API only, on a free port: the server Prefect itself would start for one command."""
    port = free_local_port()
    command = [
        sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
        "--factory", "flows.stages.prefect_app:create_app", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip
    env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    return LocalServer("temporary", command, env, port)


def persistent_server(port: int = DASHBOARD_PORT) -> LocalServer:
    """`prefect server start`: the UI, the scheduler, and a database in PREFECT_HOME that
    outlives the command (the deployments and their runs stay listed)."""
    if not _port_is_free(port):
        raise ServerStartError(
            f"port {port} is taken (another Prefect server?): point PREFECT_API_URL at it "
            f"(export PREFECT_API_URL=http://127.0.0.1:{port}/api) or pass --port with a free port"
        )
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return LocalServer("persistent", command, {"PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}, port)


@contextlib.contextmanager
def prefect_api(server: LocalServer | None = None, while_starting: Callable[[], object] = lambda: None) -> Iterator[str]:
    """The API URL to use within the block: `PREFECT_API_URL` when set, else `server`
    (default: a temporary one), started here and stopped when the block ends.
    `while_starting` runs while the server starts (a command's own imports: the two take
    about as long, and a second core does one while the first does the other)."""
    configured = PREFECT_API_URL.value()
    if configured:
        while_starting()
        with _settings_for(configured):
            yield configured
        return
    server = server or temporary_server()
    process = _start(server, float(os.environ.get(STARTUP_TIMEOUT_VARIABLE, "120")), while_starting)
    url = f"{server.address}/api"
    try:
        with _settings_for(url):
            yield url
    finally:
        _send_pending_logs_and_events()
        log.info("stopping the %s Prefect server on %s", server.kind, server.address)
        stop_group(process, grace_s=10.0)


# Prefect's client builds a new TLS context for every client it opens and loads a CA bundle into
# it (certifi's: 19 ms of CPU here, and a pipeline opens hundreds of clients), even for an
# http:// API, which never uses TLS. For such an API the contexts load this file of one
# certificate instead (under 1 ms), whatever PREFECT_API_SSL_CERT_FILE (or SSL_CERT_FILE, its
# default) names: no certificate is ever checked on plain http. A TLS API keeps the user's.
PLAIN_HTTP_CA_FILE = Path(__file__).with_name("plain-http-ca.pem")


def api_settings(url: str) -> dict[str, str]:
    """The settings of the Prefect API at `url` for this process and those it starts."""
    settings = {"PREFECT_API_URL": url}
    if url.startswith("http://"):
        settings["PREFECT_API_SSL_CERT_FILE"] = str(PLAIN_HTTP_CA_FILE)
    return settings


@contextlib.contextmanager
def _settings_for(url: str) -> Iterator[None]:
    """`api_settings(url)` within the block: in Prefect's settings here, and in the environment
    of the processes this command starts."""
    settings = api_settings(url)
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        with temporary_settings(updates={getattr(prefect.settings, name): value for name, value in settings.items()}):
            yield
    finally:
        for name, value in previous.items():
            _restore(name, value)


# Leases in files under PREFECT_HOME, not in the server's memory: a trainer slot's lease then
# outlives the server it was taken on (a temporary one ends with its command, `dlrm serve
# --with-server` stops its own), and whichever server runs next on that home revokes it once
# it expires, instead of the slot staying counted in the database for ever.
LEASE_STORAGE = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}


def _start(server: LocalServer, timeout_s: float, while_starting: Callable[[], object] = lambda: None) -> subprocess.Popen:
    env = {**LEASE_STORAGE, **os.environ, **server.env}
    env.pop("PREFECT_API_URL", None)
    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    if server.kind == "temporary":
        log.info("starting a temporary Prefect server on %s (for a dashboard that stays: `dlrm server`, "
                 "then export PREFECT_API_URL=http://127.0.0.1:%d/api)", server.address, DASHBOARD_PORT)  # fmt: skip
    else:
        log.info("starting the Prefect server with its UI on %s (state in %s)", server.address, home)
    # its output goes to a log beside its database: a failed start is one line here, naming it
    server_log = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser() / f"{server.kind}-server.log"
    server_log.parent.mkdir(parents=True, exist_ok=True)
    if server.kind == "persistent" and (new := new_database()) is not None:
        copy_template_to(new)  # the temporary server's app does this itself (flows/stages/prefect_app.py)
    with server_log.open("ab") as output:
        process = start_group(server.command, end_on_stop=False, env=env, stdout=output, stderr=output)
    try:
        while_starting()
        _wait_until_it_answers(server, process, timeout_s, server_log)
    except BaseException:  # a start that failed, timed out or was stopped leaves no server behind
        stop_group(process, grace_s=5.0)
        raise
    return process


def _wait_until_it_answers(server: LocalServer, process: subprocess.Popen, timeout_s: float, server_log: Path) -> None:
    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, verify=False) as client:  # plain http: no CA bundle to load (20 ms)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerStartError(
                    f"the {server.kind} Prefect server exited with code {process.returncode} before answering "
                    f"(its log: {server_log}); check PREFECT_HOME ({home}) or set PREFECT_API_URL to a running server"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{server.address}/api/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise ServerStartError(
        f"the {server.kind} Prefect server did not answer within {timeout_s:.0f} s (its log: {server_log}); on a "
        f"busy machine raise {STARTUP_TIMEOUT_VARIABLE}, or set PREFECT_API_URL to a running server"
    )


def server_answers(url: str) -> bool:
    """Whether the Prefect API at `url` answers its health check."""
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _send_pending_logs_and_events() -> None:
    """Flush Prefect's log and event senders while their server still answers: after it
    stops, each pending batch would retry against a closed port for about a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)


def _port_is_free(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
