"""Warm `dlrm` commands for the tests: each command forked from a process that imported the
pipeline once, in place of a new interpreter that imports it again (about 10 s of CPU each).

    test ─runs─▶ client (`python tests/warm_commands.py client SOCKET ARGS…`: the standard library only)
        client ─Unix socket: the arguments, environment, folder, stdin/stdout/stderr─▶ server
            server (imported `flows.cli` and the pipeline once) ─fork─▶ the command

The command is `flows.cli.main(ARGS)` in a process of its own, with the client's environment,
folder, descriptors and network and mount namespaces (a client on a simulated host runs its
command on that host): what it prints, its exit code and its own child processes are those
of `python -m flows.cli ARGS`. The client forwards SIGINT, SIGTERM and SIGHUP to the
command's process group, exits with its exit code (or by the signal that ended it), and a
client killed outright has the server stop the command (SIGTERM to its group).

What a forked command does not test: the interpreter's start (`dlrm --help`'s time, the
console script, `PYTHONPATH`) and code changed after the server started. Tests of the
command's start, its stops and its processes (test_stopping.py, Ctrl-C across hosts and on
Slurm, `dlrm serve` in the production stack) run it as a new process. Commands run in the test
process itself would share its Prefect and MLflow state; these do not.

The top of this module imports the standard library only: the client runs it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

_MESSAGE_BYTES = 1 << 20
_FDS = 5  # stdin, stdout, stderr, and the client's network and mount namespaces
_CLIENT = str(Path(__file__).resolve())
_ROOT = Path(__file__).resolve().parents[1]
# The modules a command would import: the pipeline and what its stages and reports load,
# and what MLflow and Optuna import on first use (their SQL stores: about 1 s a command);
# the server adds what training imports on first use (warm_ranks.FIRST_USE_IMPORTS).
_PRELOADED = ("flows.cli", "flows.cli.commands", "flows.deployments.pipeline", "flows.deployments.serve",
              "flows.run.reports", "flows.stages.local_server", "flows.tracking.model_delta", "flows.tuning.retune",
              "flows.deployments.characterize", "evaluation.metrics", "mlflow.store.tracking.sqlalchemy_store",
              "mlflow.store.model_registry.sqlalchemy_store", "optuna.storages._rdb.storage")  # fmt: skip


COLD_KEY = "DLRM_TESTS_COLD_COMMANDS"  # set (to 1) to run every test's `dlrm` in a new interpreter
_STARTED: list[Path] = []  # this process's server's socket, once started


def dlrm() -> list[str]:
    """The start of a `dlrm` command line for a test: a warm command of this process's server
    (started on first use, stopped when the process ends), or a new interpreter when
    `DLRM_TESTS_COLD_COMMANDS` is set."""
    if os.environ.get(COLD_KEY):
        return command_line(None)
    if not _STARTED:
        folder = Path(tempfile.mkdtemp(prefix="warm-dlrm-"))  # short: a Unix socket's path has ~100 bytes
        server = start_server(folder / "server.sock")
        atexit.register(_stop_and_remove, server, folder)
        _STARTED.append(folder / "server.sock")
    return command_line(_STARTED[0])


def _stop_and_remove(server: subprocess.Popen, folder: Path) -> None:
    stop_server(server)
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def command_line(server: Path | None) -> list[str]:
    """The start of a `dlrm` command line: the warm client of `server`, or a new interpreter."""
    if server is None:
        return [sys.executable, "-m", "flows.cli"]
    return [sys.executable, "-I", _CLIENT, "client", str(server)]


def start_server(path: Path, timeout_s: float = 180.0) -> subprocess.Popen:
    """A server listening on `path` once this returns; it ends with the process that started it."""
    path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, _CLIENT, "serve", str(path)], cwd=_ROOT, env=env,
                              stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if server.poll() is not None:
            raise RuntimeError(f"the warm-command server exited with code {server.returncode} before listening")
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the warm-command server did not listen on {path} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return server


def stop_server(server: subprocess.Popen) -> None:
    """End the server and any command it forked that is still running (its own group each)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


# ---- the server ----------------------------------------------------------------------------


def serve(path: Path) -> None:
    """Import the pipeline, listen on `path`, fork a command for each request. Ends on SIGTERM,
    which the test process that started it sends as it ends (its running commands too)."""
    import importlib

    from training.launch.interpreter import imports_without_collection
    from training.launch.processes import die_with_parent
    from training.launch.warm_ranks import FIRST_USE_IMPORTS, fork_for_request, listen_on

    die_with_parent(signal.SIGTERM)
    with imports_without_collection():  # as a command's own start does; frozen before the forks
        for name in (*_PRELOADED, *FIRST_USE_IMPORTS):
            importlib.import_module(name)
    listener = listen_on(path)
    clients: dict[int, socket.socket | None] = {}  # a running command's pid -> its client (None: gone)

    def stop(_signum: int, _frame: object) -> None:
        for pid in clients:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        ready, _, _ = select.select([listener, *filter(None, clients.values())], [], [], 0.5)
        _report_ended(clients)
        for pid, connection in list(clients.items()):
            if connection is not None and connection in ready and _client_left(connection):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)  # the client was killed outright: the command stops
                connection.close()
                clients[pid] = None
        if listener not in ready:
            continue

        def command(connection: socket.socket, request: dict, fds: list[int]) -> None:
            for other in (connection, *filter(None, clients.values())):
                other.close()
            os._exit(_run_command(request, fds))  # the interpreter's exit work ran inside (see there)

        accepted = fork_for_request(listener, _FDS, "pid", command)
        if accepted is not None:
            pid, connection = accepted
            clients[pid] = connection


def _client_left(connection: socket.socket) -> bool:
    """Whether a client's connection, ready to read, was closed (clients send nothing more)."""
    try:
        return not connection.recv(1)
    except OSError:
        return True


def _report_ended(clients: dict[int, socket.socket | None]) -> None:
    """Each ended command's exit code to its client (negative: the signal that ended it)."""
    while clients:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = clients.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            connection.close()


def _run_command(request: dict, fds: list[int]) -> int:
    """One command, as `python -m flows.cli` runs it; returns its exit code once the
    interpreter's exit work (atexit handlers, buffered output) is done, as at a real exit."""
    import atexit

    from training.launch.warm_ranks import enter_namespaces

    code = 1
    try:
        os.setsid()  # the client's signals reach the command and what it starts through this group
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        enter_namespaces(fds[3:])  # a client on a simulated host has its command run there
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [str(_ROOT / "flows" / "cli" / "__main__.py"), *request["argv"]]
        from prefect.context import refresh_global_settings_context

        import flows.cli

        flows.cli.prepare_environment()
        refresh_global_settings_context()  # Prefect read its settings from the server's environment
        code = flows.cli.exit_code_of(request["argv"])  # as the console script ends
    except BaseException:  # noqa: BLE001 - the command's set-up failed: its traceback and exit code 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


# ---- the client ------------------------------------------------------------------------------


def client(server: Path, argv: list[str]) -> int:
    """Hand the command to the server; forward stop signals to it; exit as it exits."""
    sys.path.insert(0, str(_ROOT))  # the warm-rank client's pieces: the standard library's only
    from training.launch.warm_ranks import ForwardedStops, end_as_reported, hand_over, namespace_descriptors

    stops = ForwardedStops()
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    namespaces = namespace_descriptors()
    connection = hand_over(server, request, [0, 1, 2, *namespaces], "warm-command server at {server} ({reason})")
    if connection is None:
        return 2
    return end_as_reported(connection, stops, "pid", _server_ended_first)


def _server_ended_first() -> int:
    print("the warm-command server ended before the command did", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(Path(sys.argv[2]))
    else:
        sys.exit(client(Path(sys.argv[2]), sys.argv[3:]))
