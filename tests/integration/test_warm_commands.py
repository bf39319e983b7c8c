"""The tests' warm `dlrm` commands (tests/warm_commands.py) stand where `python -m flows.cli`
stands: the same output, exit codes and environment, and a stop reaches the command and
what it started; a client killed outright stops its command."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_commands
from ports import free_port
from process_tree import alive, descendants

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COLD = [sys.executable, "-m", "flows.cli"]


def _both(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, ...]:
    return tuple(subprocess.run([*start, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
                 for start in (warm_commands.dlrm(), COLD))  # fmt: skip


def test_a_warm_command_prints_and_exits_as_a_new_interpreter_does(tmp_path: Path) -> None:
    warm, cold = _both("--help")
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout) == (0, cold.stdout) and "usage: dlrm" in warm.stdout
    # a user error, from another folder and with an environment of its own (the project's
    # embedded default config is found from any folder; the data folder allowed is the env's)
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nbatch_sise = 4\n")
    warm, cold = _both("run", "--config", str(bad), cwd=tmp_path, env={**os.environ, "DLRM_DATA_DIRS": str(tmp_path)})
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.returncode == 2 and warm.stderr.startswith("dlrm: error: ") and warm.stderr.count("\n") == 1
    warm, cold = _both("run", "--no-such-flag")
    assert warm.returncode == cold.returncode == 2 and warm.stderr == cold.stderr


def _serving(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _ended(pids: set[int], timeout_s: float = 60) -> set[int]:
    """Those of `pids` still alive after waiting up to `timeout_s` for them all to end."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = {pid for pid in pids if alive(pid)}
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _dlrm_server(tmp_path: Path) -> tuple[subprocess.Popen, set[int], Path]:
    """A warm `dlrm server` once it answers: the client, the processes the command is (forked
    under this process's warm server, not under the client) and started, and its log."""
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    command = warm_commands.dlrm()  # the warm server runs before the processes are counted
    before = descendants(os.getpid())
    client = subprocess.Popen([*command, "server", "--port", str(port)], cwd=ROOT, env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT)  # fmt: skip
    _serving(port, client, log)
    return client, descendants(os.getpid()) - before - {client.pid}, log


def test_ctrl_c_reaches_a_warm_command_and_what_it_started(tmp_path: Path) -> None:
    client, started, log = _dlrm_server(tmp_path)
    assert len(started) >= 2, "the command and the Prefect server it started"
    client.send_signal(signal.SIGINT)
    assert client.wait(timeout=60) == 130, log.read_text()[-3000:]
    assert "dlrm: stopped by SIGINT" in log.read_text()
    assert _ended(started) == set()


def test_a_client_killed_outright_stops_its_command(tmp_path: Path) -> None:
    client, started, _ = _dlrm_server(tmp_path)
    assert len(started) >= 2, "the command and the Prefect server it started"
    client.kill()
    client.wait()
    assert _ended(started) == set(), "the server stopped the command, and the command what it started"
