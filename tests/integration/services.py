"""Starting the stack's services natively, with the scripts docker-compose.yml runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
POSTGRES = "postgres@127.0.0.1:5432"
VENV_BIN = Path(sys.executable).parent


def base_env(home: Path) -> dict[str, str]:
    return {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
            "PREFECT_HOME": str(home / "prefect-server"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # fmt: skip


def start_service(script: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(ROOT / "infra" / script)], env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def start_mlflow(home: Path, port: int, backend: str, log: Path) -> subprocess.Popen:
    env = {**base_env(home), "MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1", "MLFLOW_BACKEND_STORE_URI": backend,
           "MLFLOW_ARTIFACTS_DESTINATION": str(home / "mlartifacts")}  # fmt: skip
    process = start_service("mlflow-server.sh", env, log)
    wait_for(f"http://127.0.0.1:{port}/health", process, log)
    return process


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_for(url: str, process: subprocess.Popen, log: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{url} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):  # not listening yet
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {seconds:.0f} s:\n{log.read_text()[-3000:]}")


def create_database(name: str) -> str:
    import psycopg

    with psycopg.connect(f"postgresql://{POSTGRES}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql://{POSTGRES}/{name}"


def drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(f"postgresql://{POSTGRES}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def postgres_answers() -> bool:
    """Whether the local PostgreSQL server takes connections (trust auth, user postgres)."""
    import psycopg

    try:
        with psycopg.connect(f"postgresql://{POSTGRES}/postgres", connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def databases_named(prefix: str) -> list[str]:
    import psycopg

    with psycopg.connect(f"postgresql://{POSTGRES}/postgres", autocommit=True) as admin:
        rows = admin.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,)).fetchall()
    return [row[0] for row in rows]
