"""The Prefect API one `dlrm` command talks to: the server `PREFECT_API_URL` names, or else
a temporary local server that the command starts and stops itself.

Prefect would start that temporary server on its own, but in the command's process group:
a Ctrl-C in the terminal then kills the server first, and the flow runs, still being
stopped, can no longer be marked (they stay "Running", the clean-up fails against a dead
API). Here the server runs in its own session (`training.processes`), so the command stops
its work, marks its runs, and stops the server last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import prefect
from prefect.settings import PREFECT_API_URL, temporary_settings

from training.processes import start_group, stop_group

log = logging.getLogger("flows.server")
STARTUP_TIMEOUT_VARIABLE = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class ServerStartError(RuntimeError):
    """The temporary Prefect server did not answer in time (shown as one line)."""


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """The API URL to use within the block; a temporary server lives as long as the block."""
    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    timeout_s = float(os.environ.get(STARTUP_TIMEOUT_VARIABLE, "120"))
    process, url = _start(timeout_s)
    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url  # processes this command starts use it too
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        _restore("PREFECT_API_URL", previous)
        _send_pending_logs_and_events()
        log.info("stopping the temporary Prefect server on %s", url.removesuffix("/api"))
        stop_group(process, grace_s=5.0)


def _start(timeout_s: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [
        sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
        "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip
    # the settings Prefect gives its own temporary server: API only, one process's database
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    url = f"http://127.0.0.1:{port}/api"
    log.info("starting a temporary Prefect server on http://127.0.0.1:%d (set PREFECT_API_URL to use a "
             "persistent one: see the README's dashboard section)", port)  # fmt: skip
    process = start_group(command, end_on_stop=False, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerStartError(
                    f"the temporary Prefect server exited with code {process.returncode} before answering; "
                    f"check PREFECT_HOME ({os.environ.get('PREFECT_HOME', '~/.prefect')}) or set PREFECT_API_URL "
                    "to a running server"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return process, url
            time.sleep(0.2)
    stop_group(process, grace_s=5.0)
    raise ServerStartError(
        f"the temporary Prefect server did not answer within {timeout_s:.0f} s; on a busy machine raise "
        f"{STARTUP_TIMEOUT_VARIABLE}, or set PREFECT_API_URL to a running server"
    )


def _send_pending_logs_and_events() -> None:
    """Flush Prefect's log and event senders while their server still answers: after it
    stops, each pending batch would retry against a closed port for about a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
