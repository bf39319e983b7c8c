"""Warm ranks: a single-host training job started by forking processes that have already
imported the trainer, in place of torchrun. For test suites and development loops that run
many small jobs; a deployment keeps torchrun.

A torchrun launch imports torch in torchrun and torch, TorchRec and fbgemm in every rank:
about 2.5 s of CPU per process, more than a tiny job's training. A warm-rank server
imports `training.worker` once and forks each job from itself:

    launcher ─torchrun's place─▶ client (stdlib only: starts in milliseconds)
        client ─Unix socket: the job, its environment, its stdout and stderr─▶ server (imported once)
            server ─fork─▶ agent (one per job, its own process group)
                agent ─fork─▶ rank 0 … rank N-1 (`training.worker.main`, the env:// variables
                              torchrun sets, output teed into the job's log folder as torchrun tees it)

The client stands where torchrun stands for the launcher (the same output, the same exit
code, torchrun's failure report naming the rank that failed first), so the launcher's
relaunches, progress polling and stops work unchanged:
- a SIGTERM or SIGINT to the client goes to the agent's process group (every rank);
- a client killed outright closes its socket, and the agent then kills the ranks;
- the server ends with the process that started it, the agent with the server and the ranks
  with their agent (parent-death signals).

A job across hosts keeps torchrun on every host (its rendezvous, output, failure report and
stops are what such a job tests), and each rank torchrun starts is forked from the server:

    torchrun ─▶ `training.launch.rank JOB.json` (the stand-in: stdlib only)
        ─Unix socket: its environment (torchrun's RANK, MASTER_ADDR, …), its stdout and stderr,
         its network and mount namespaces (a simulated host's)─▶ server
            server ─fork─▶ watcher ─fork─▶ the rank (`training.worker.main`, in those namespaces)

The stand-in forwards torchrun's stops to the rank, and ends as the rank ended (its exit code,
or the signal that killed it), so torchrun reports and stops it as its own child. A job on one
host takes the same path with `DLRM_WARM_RANKS_UNDER_TORCHRUN=1` (the tests of the launcher:
torchrun's stops and failure reports are what they test, not a rank's interpreter start).

`DLRM_WARM_RANKS=<socket>` turns it on (`training/launch/launcher.py`, `training/launch/rank.py`);
`start_server` starts a server (tests/conftest.py starts one per test process). A server runs
the code it imported when it started: a changed trainer needs a new server.

The top of this module imports the standard library only: the client runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from training.launch.host_role import free_local_port  # these three: the standard library's only
from training.launch.interpreter import imports_without_collection
from training.launch.processes import die_with_parent, forget_group, start_group, write_all

ENVIRONMENT_KEY = "DLRM_WARM_RANKS"
UNDER_TORCHRUN_KEY = "DLRM_WARM_RANKS_UNDER_TORCHRUN"  # "1": a job on one host keeps torchrun too
_NAMESPACES = (("net", 0x40000000), ("mnt", 0x00020000))  # CLONE_NEWNET, CLONE_NEWNS (<sched.h>)
# A job's client passes its stdout and stderr; a rank's stand-in those and its two namespaces
_MOST_FDS = 2 + len(_NAMESPACES)
_MESSAGE_BYTES = 1 << 20
STOP_GRACE_S = 5.0  # a failed job's other ranks get this long after SIGTERM before SIGKILL


def server_socket() -> Path | None:
    """The warm-rank server this process's jobs use, or None (torchrun)."""
    value = os.environ.get(ENVIRONMENT_KEY, "").strip()
    return Path(value) if value else None


def keeps_torchrun() -> bool:
    """Whether a job on one host launches under torchrun even with a server named, its ranks
    forked by the server as a job across hosts has them."""
    return os.environ.get(UNDER_TORCHRUN_KEY, "").strip() == "1"


def client_command(server: Path, job_path: Path, nproc: int, log_dir: Path) -> list[str]:
    """The command that stands in torchrun's place for one single-host launch."""
    return [sys.executable, "-m", "training.launch.warm_ranks", "client", str(server), str(job_path), str(nproc),
            str(log_dir)]  # fmt: skip


def start_server(path: Path, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start a server listening on `path`, ended with this process; returns once it listens.

    A service to this process's stops (training/launch/processes.py): a Ctrl-C ends the jobs
    it forked (their agents' groups are this process's stop's to end, as torchrun's are), not
    the server that later runs still need."""
    path.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    server = start_group([sys.executable, "-m", "training.launch.warm_ranks", "serve", str(path)], end_on_stop=False,
                         death_signal=signal.SIGKILL, env=env)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if server.poll() is not None:
            raise RuntimeError(f"the warm-rank server exited with code {server.returncode} before listening")
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the warm-rank server did not listen on {path} within {timeout_s:.0f} s")
        time.sleep(0.05)
    return server


def stop_server(server: subprocess.Popen) -> None:
    """End a server `start_server` started (the jobs it forked end with it)."""
    server.kill()
    server.wait()
    forget_group(server)


# ---- the server -------------------------------------------------------------------------


# What a job's ranks import on first use, beyond `training.worker`'s own imports: TorchRec's
# optimizer in the backward pass imports torch.distributed.optim (its TorchScript optimizers)
# as the model is built, pyarrow's to_numpy imports pandas on the first batch, and a CPU
# host's build imports this project's CPU kernels. Imported once by the server, not again in
# every rank of every job: a tiny job's launch took 3.98 s of CPU with them in the ranks,
# 2.87 s without (bench/launch_overhead.py; docs/performance.md).
FIRST_USE_IMPORTS = ("torch.distributed.optim", "pandas", "training.cpu")


def import_the_trainer() -> None:
    """Import what every job's ranks import: the trainer and `FIRST_USE_IMPORTS`, without the
    collector and then frozen, so that a forked rank's collections neither walk nor copy them."""
    with imports_without_collection():
        import training.worker  # noqa: F401

        for name in FIRST_USE_IMPORTS:
            importlib.import_module(name)


def serve(path: Path) -> None:
    """Import the trainer, listen on `path`, fork an agent for each request; never returns.
    (It ends with the process that started it: `start_server` ties it to that one's life.)"""
    import_the_trainer()

    listener = listen_on(path)
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        _reap()
        if not ready:
            continue
        accepted = fork_for_request(listener, _MOST_FDS, "agent", _run_request)
        if accepted is not None:
            accepted[1].close()


def _run_request(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """A job (the client stands in for torchrun) or one rank (the client is torchrun's rank);
    either ends this process."""
    if request.get("rank"):
        _watch_one_rank(connection, request, fds)
    else:
        _run_agent(connection, request, fds)


def listen_on(path: Path) -> socket.socket:
    """A Unix socket listening at `path`, which appears only once it accepts connections."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staged = path.with_name(path.name + ".staged")
    staged.unlink(missing_ok=True)
    listener.bind(str(staged))
    listener.listen(64)
    staged.rename(path)
    return listener


def receive_request(connection: socket.socket, fds: int) -> tuple[dict, list[int]] | None:
    """A client's request (one JSON message) and the `fds` descriptors it passed; None, and
    the connection closed, when it sent none that reads."""
    received: list[int] = []
    try:
        message, received, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, fds)
        return json.loads(message), received
    except (OSError, ValueError):
        for fd in received:  # a message that does not read: its descriptors are not kept open
            os.close(fd)
        connection.close()
        return None


def fork_for_request(listener: socket.socket, fds: int, reply_key: str,
                     child: Callable[[socket.socket, dict, list[int]], None]) -> tuple[int, socket.socket] | None:  # fmt: skip
    """Accept one client and fork `child(connection, request, descriptors)` for its request (the
    child ends in it, with the listener closed); the parent closes its copies of the passed
    descriptors and tells the client the child's pid (`{reply_key: pid}`). Returns the child's
    pid and the connection, or None when the client sent no request that reads."""
    connection, _ = listener.accept()
    received = receive_request(connection, fds)
    if received is None:
        return None
    request, passed = received
    pid = os.fork()
    if pid == 0:
        listener.close()
        child(connection, request, passed)
        os._exit(1)  # a child that returned: it was meant to end inside
    for fd in passed:
        os.close(fd)
    with contextlib.suppress(OSError):
        connection.send(json.dumps({reply_key: pid}).encode())
    return pid, connection


def _reap() -> None:
    """Collect the agents that ended (their clients read the exit code from the agent)."""
    ended = -1
    with contextlib.suppress(ChildProcessError):  # no child left
        while ended:  # 0: children left, none ended yet
            ended, _ = os.waitpid(-1, os.WNOHANG)


# ---- the agent: one job ---------------------------------------------------------------------


def _report_and_leave(connection: socket.socket, work: Callable[[], int]) -> None:
    """A forked child's `work`, its exit code sent to the client (1 if it raised, whatever
    it raised); then `_exit`: a child of the server never returns into the server's loop."""
    code = 1
    try:
        code = work()
    except BaseException:  # noqa: BLE001 - the child must report and leave, whatever happened
        traceback.print_exc()
    finally:
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"exit": code}).encode())
        os._exit(0)


def _run_agent(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """One job's ranks: forked, watched, reported as torchrun reports them; then `_exit`."""

    def job() -> int:
        os.setsid()  # the client's stop reaches every rank through this group
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        return _agent(connection, Path(request["job"]), int(request["nproc"]), Path(request["log_dir"]))

    _report_and_leave(connection, job)


def _agent(connection: socket.socket, job_path: Path, nproc: int, log_dir: Path) -> int:
    port = free_local_port()
    run_logs = log_dir / f"warm_{os.getpid()}" / "attempt_0"
    ranks: dict[int, int] = {}  # pid -> local rank
    readers: list[threading.Thread] = []
    output_lock = threading.Lock()
    pipes = []
    for rank in range(nproc):
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in (out_read, err_read, *(fd for pair in pipes for fd in pair)):
                os.close(fd)
            connection.close()
            _run_rank(rank, nproc, port, job_path, out_write, err_write)  # never returns
        os.close(out_write)
        os.close(err_write)
        pipes.append((out_read, err_read))
        ranks[pid] = rank
    # Threads only now: the ranks were forked from a process with one thread.
    for rank, (out_read, err_read) in enumerate(pipes):
        folder = run_logs / str(rank)
        folder.mkdir(parents=True, exist_ok=True)
        for fd, name in ((out_read, "stdout.log"), (err_read, "stderr.log")):
            reader = threading.Thread(target=_tee, args=(fd, folder / name, f"[default{rank}]:", output_lock), daemon=True)
            reader.start()
            readers.append(reader)
    ended = threading.Event()
    threading.Thread(target=_end_when_client_leaves, args=(connection, set(ranks), ended), daemon=True).start()
    codes = _wait_for_ranks(ranks)
    ended.set()  # their pids may be reused from here on
    for reader in readers:
        reader.join(timeout=10)
    if all(code == 0 for code in codes.values()):
        return 0
    _report_failure(codes, {rank: pid for pid, rank in ranks.items()}, output_lock)
    return 1


def _run_rank(rank: int, nproc: int, port: int, job_path: Path, stdout_fd: int, stderr_fd: int) -> None:
    """One rank: the variables torchrun gives a worker, then the worker's main; `_exit`."""
    code = 1
    try:
        die_with_parent()
        _output_to(stdout_fd, stderr_fd)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})  # fmt: skip
        code = _worker_exit_code([str(job_path)])
    except BaseException:  # noqa: BLE001 - the traceback is the rank's report, as under torchrun
        traceback.print_exc()
    _exit_without_teardown(code)


def _output_to(stdout_fd: int, stderr_fd: int) -> None:
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _worker_exit_code(argv: list[str]) -> int:
    """The worker's main on `argv`, and the exit code `python -m training.launch.rank` would end with."""
    from training.worker import main

    try:
        main(argv)
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    return 0


def _exit_without_teardown(code: int) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: see training.worker.exit_skipping_teardown


# ---- one rank that torchrun started -----------------------------------------------------------


def _watch_one_rank(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """Fork the rank, tell its stand-in how it ended; then `_exit`. The watcher ignores the
    stops the stand-in forwards to its group: they are the rank's, whose end it reports."""

    def watch() -> int:
        os.setsid()  # the stand-in's stops reach the rank through this group
        die_with_parent()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        pid = os.fork()
        if pid == 0:
            connection.close()
            _run_torchruns_rank(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        ended = threading.Event()  # a thread only now: the rank was forked from one thread
        threading.Thread(target=_end_when_client_leaves, args=(connection, {pid}, ended), daemon=True).start()
        _, status = os.waitpid(pid, 0)
        ended.set()
        return os.waitstatus_to_exitcode(status)

    _report_and_leave(connection, watch)


def _run_torchruns_rank(request: dict, fds: list[int]) -> None:
    """The rank, as `python -m training.launch.rank` runs under torchrun: in the stand-in's
    namespaces, folder, environment and streams, with Python's own signal handling; `_exit`."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        enter_namespaces(fds[2:])
        _output_to(fds[0], fds[1])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        code = _worker_exit_code(list(request["argv"]))
    except BaseException:  # noqa: BLE001 - the traceback is the rank's report, as under torchrun
        traceback.print_exc()
    _exit_without_teardown(code)


def enter_namespaces(namespaces: list[int]) -> None:
    """Enter the network and mount namespaces whose descriptors a client passed (`_NAMESPACES`'
    order), and close them. A client on a simulated host (a network namespace with its own
    /etc/hosts: tests/integration/test_multi_host.py, the Slurm nodes) has what it asked for run
    there, where it binds, connects and resolves; elsewhere both are the server's and nothing
    changes. setns(2) enters a mount namespace only in a process of one thread: a forked child."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for fd, (name, flag) in zip(namespaces, _NAMESPACES, strict=True):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino and libc.setns(fd, flag) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter the client's {name} namespace")
        os.close(fd)


def namespace_descriptors() -> list[int]:
    """This process's network and mount namespaces, opened for a server to enter (`enter_namespaces`)."""
    return [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name, _ in _NAMESPACES]


def _tee(fd: int, log: Path, prefix: str, lock: threading.Lock) -> None:
    """A rank's stream into its log file and, prefixed as torchrun prefixes it, to stdout."""
    with os.fdopen(fd, "rb") as stream, log.open("wb") as file:
        for line in stream:
            file.write(line)
            file.flush()
            with lock:
                write_all(1, prefix.encode() + line)


def _end_when_client_leaves(connection: socket.socket, pids: set[int], ended: threading.Event) -> None:
    """The client was killed outright (its socket closed): the job ends too."""
    with contextlib.suppress(OSError):
        connection.recv(1)
    for pid in pids if not ended.is_set() else ():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for_ranks(ranks: dict[int, int]) -> dict[int, int]:
    """Every rank's exit code (negative: the signal that ended it). The first failure
    ends the others, SIGTERM then SIGKILL, as torchrun does."""
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline is not None else os.waitpid(-1, 0)
        if pid == 0:
            if time.monotonic() > deadline:
                for other in set(ranks) - set(codes):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and deadline is None:
            deadline = time.monotonic() + STOP_GRACE_S
            for other in set(ranks) - set(codes):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
    return {ranks[pid]: code for pid, code in codes.items()}


def _report_failure(codes: dict[int, int], pids: dict[int, int], lock: threading.Lock) -> None:
    """torchrun's failure report (the form `training.launch.output` reads): every rank that
    ended badly, the first non-SIGTERM one as the root cause."""
    failed = [rank for rank in sorted(codes) if codes[rank] != 0]
    root = min(failed, key=lambda rank: (codes[rank] == -signal.SIGTERM, rank))
    now = time.strftime("%Y-%m-%d_%H:%M:%S")

    def record(rank: int) -> str:
        return (f"  time      : {now}\n  host      : {socket.gethostname()}\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {codes[rank]} (pid: {pids[rank]})\n")  # fmt: skip

    others = [rank for rank in failed if rank != root]
    text = "training.worker FAILED (warm ranks)\n"
    text += "Failures:\n" + ("".join(f"[{i + 1}]:\n{record(rank)}" for i, rank in enumerate(others)) or "  <NO_OTHER_FAILURES>\n")
    text += "Root Cause (first observed failure):\n[0]:\n" + record(root)
    with lock:
        write_all(1, text.encode())


# ---- the client: torchrun's stand-in ---------------------------------------------------------


class ForwardedStops:
    """A client's SIGINT, SIGTERM and SIGHUP, forwarded to the process group its server names;
    a signal that comes before the server has named it goes there once it does."""

    def __init__(self) -> None:
        self.group: int | None = None
        self.stopped: list[int] = []
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._forward)

    def _forward(self, signum: int, _frame: object) -> None:
        self.stopped.append(signum)
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.group, signum)

    def started(self, group: int) -> None:
        self.group = group
        if self.stopped:
            self._forward(self.stopped[-1], None)


def hand_over(server: Path, request: dict, fds: list[int], no_server: str) -> socket.socket | None:
    """Send `request` and the descriptors `fds` to the server at `server`; None, with one line
    on stderr (`no_server` after the reason), when nothing listens there."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(str(server))
    except OSError as error:
        print(f"no {no_server.format(server=server, reason=error.strerror)}", file=sys.stderr)
        return None
    socket.send_fds(connection, [json.dumps(request).encode()], fds)
    return connection


def client(server: Path, job_path: Path, nproc: int, log_dir: Path) -> int:
    """Hand the job to the server; forward stop signals to its agent; exit as it exits."""
    stops = ForwardedStops()
    request = {"job": str(job_path), "nproc": nproc, "log_dir": str(log_dir), "env": dict(os.environ), "cwd": os.getcwd()}
    connection = hand_over(server, request, [1, 2], "warm-rank server at {server} ({reason}): unset "
                           f"{ENVIRONMENT_KEY} to launch with torchrun")  # fmt: skip
    if connection is None:
        return 2
    return end_as_reported(connection, stops, "agent", lambda: 128 + stops.stopped[0] if stops.stopped else 1)


def rank_client(server: Path, argv: list[str]) -> int:
    """torchrun's rank, forked by the server (`_watch_one_rank`): forward torchrun's stops to
    it, and end as it ended (by the same signal when one killed it). Like the rank it stands in
    for (training/worker.py), it dies with a torchrun killed outright (the launcher kills one
    whose parent ended first); its watcher then ends the rank (`_end_when_client_leaves`)."""
    die_with_parent()
    stops = ForwardedStops()
    request = {"rank": True, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    no_server = f"warm-rank server at {{server}} ({{reason}}): unset {ENVIRONMENT_KEY} to start ranks anew"
    connection = hand_over(server, request, [1, 2, *namespace_descriptors()], no_server)
    if connection is None:
        return 2
    # a watcher that ended without a word: the server was killed
    return end_as_reported(connection, stops, "agent", lambda: 128 + stops.stopped[0] if stops.stopped else 1)


def end_as_reported(connection: socket.socket, stops: ForwardedStops, started_key: str,
                    unsaid: Callable[[], int]) -> int:  # fmt: skip
    """A client's end: the server's replies read until the exit code (the process it names
    under `started_key` gets the client's stops); the code returned, or the client killed by
    the signal that ended the process. `unsaid()` when the server's side closed without one."""
    while True:
        message = connection.recv(_MESSAGE_BYTES)
        if not message:
            return unsaid()
        reply = json.loads(message)
        if started_key in reply:
            stops.started(reply[started_key])
        if "exit" not in reply:
            continue
        code = int(reply["exit"])
        if code < 0:  # ended by a signal: end the same way (torchrun's report names it)
            if -code != signal.SIGKILL:  # the one signal whose handler cannot be set (nor needs to be)
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        return code


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(Path(argv[1]))
    if argv[:1] == ["client"] and len(argv) == 5:
        return client(Path(argv[1]), Path(argv[2]), int(argv[3]), Path(argv[4]))
    print("usage: python -m training.launch.warm_ranks serve SOCKET | client SOCKET JOB.json NPROC LOG_DIR",
          file=sys.stderr)  # fmt: skip
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
