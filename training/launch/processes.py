"""Child process groups that end with the program that started them, and a stop on SIGINT
or SIGTERM that reaches every one of them.

A job's torchrun and a temporary Prefect server run in their own sessions, so a Ctrl-C in
the terminal reaches only the `dlrm` process: it then decides the order of the stop (end
the training, mark the runs, stop the server last), instead of every process dying at once
and the survivors failing against a dead API. Each group is also tied to its parent's life
(Linux's parent-death signal): a parent killed outright (SIGKILL) leaves no orphan.

The first SIGINT or SIGTERM raises `Stopped` in the main thread and terminates every
registered group, and every other session this process started (Prefect's runner starts
each served flow run in one of its own): all at once, then killed after a grace, so a stop
takes one grace however many runs were going (the runner would end them one by one, 30 s
each). Later signals only say that the stop is under way, so a second Ctrl-C cannot
interrupt the clean-up and leave orphans.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
_groups: set[int] = set()
_services: set[int] = set()  # groups the clean-up still needs: stopped by their owner, last
# Re-entrant: the signal handler takes it on the main thread, which the signal may have
# interrupted while holding it.
_lock = threading.RLock()
_stop_signal: list[int] = []  # the signal that asked for the stop; empty while none has
_held: list[bool] = []  # one entry per `stops_held` block the main thread is in
_deferred: list[int] = []  # a stop's signal, raised when the last held block ends


class Stopped(KeyboardInterrupt):
    """The program was asked to stop (SIGINT or SIGTERM). A `KeyboardInterrupt`, so Prefect
    and MLflow treat it as an interruption (a crashed flow run, a failed MLflow run) and no
    retry policy catches it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def stop_requested() -> int | None:
    """The signal that asked this program to stop, or None."""
    return _stop_signal[0] if _stop_signal else None


def raise_if_stopped() -> None:
    if _stop_signal:
        raise Stopped(_stop_signal[0])


def start_group(command: Sequence[str], *, end_on_stop: bool = True, death_signal: int = signal.SIGTERM,
                **popen: Any) -> subprocess.Popen:  # fmt: skip
    """Start `command` as the leader of a new session, tied to this process's life.

    `end_on_stop`: a stop terminates the group at once (work: a training job). A service
    the clean-up still needs (the Prefect API that the runs are marked through) passes
    False and is stopped by its owner, last. `death_signal`: what the command receives if
    this process dies first (SIGKILL for a command whose own SIGTERM handling cannot be
    trusted without its parent)."""
    raise_if_stopped()  # a stop that came first must not be followed by a new child
    process = subprocess.Popen(_tied_to_this_process(command, death_signal), start_new_session=True, **popen)
    with _lock:
        (_groups if end_on_stop else _services).add(process.pid)
    return process


def stop_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the process's whole group, SIGKILL after `grace_s`; then forget it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    forget_group(process)


def forget_group(process: subprocess.Popen) -> None:
    """The group ended on its own: a later stop need not signal it."""
    with _lock:
        _groups.discard(process.pid)
        _services.discard(process.pid)


# Run first in the child: ask for a signal when the parent dies (it survives the exec), give
# up if the parent is already gone, then become the command. A trampoline rather than
# `preexec_fn`, which is unsafe in a threaded parent (Prefect's and the heartbeat's threads).
_TRAMPOLINE = (
    f"import ctypes, os, sys; ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, int(sys.argv[2]), 0, 0, 0); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(143); os.execvp(sys.argv[3], sys.argv[3:])"
)


def _tied_to_this_process(command: Sequence[str], death_signal: int = signal.SIGTERM) -> list[str]:
    """`command`, started through the trampoline on Linux (elsewhere the explicit stop is
    the only guard)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), str(int(death_signal)), *command]


def die_with_parent(death_signal: int = signal.SIGKILL) -> None:
    """Have this process receive `death_signal` when its parent ends (Linux; elsewhere
    nothing): a torchrun worker whose torchrun was killed must not train on as an orphan."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the request took effect
        os.kill(os.getpid(), death_signal)


KILL_AFTER_S = 15.0  # a group still there this long after the SIGTERM is killed


def _terminate_groups() -> None:
    with _lock:
        groups = (set(_groups) | _child_sessions()) - _services
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    if groups:
        threading.Thread(target=_kill_left, args=(groups,), name="stop-kill", daemon=True).start()


def _kill_left(groups: set[int]) -> None:
    """SIGKILL the groups of `groups` still alive after the grace (their processes ignored the
    SIGTERM, or their clean-up hangs): a stop ends in bounded time."""
    deadline = time.monotonic() + KILL_AFTER_S
    while groups and time.monotonic() < deadline:
        time.sleep(0.5)
        groups = {pgid for pgid in groups if _group_alive(pgid)}
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _child_sessions() -> set[int]:
    """This process's children that lead a session of their own (Linux: read from /proc;
    elsewhere none are found and only the registered groups are signalled)."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # after the command's name (in parentheses, which may hold spaces): state, ppid, pgrp, session
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        pid = int(stat.parent.name)
        if int(fields[1]) == me and int(fields[3]) == pid:
            found.add(pid)
    return found


def write_line_to_stderr(line: str) -> None:
    """`line` straight to the standard error's file descriptor: no Python-level buffer,
    logger or lock between, so a signal handler may call it whatever it interrupted."""
    write_all(2, (line + "\n").encode(errors="replace"))


def write_all(fd: int, data: bytes) -> None:
    """Every byte of `data` to the file descriptor `fd`, with no buffer or lock between; a
    descriptor that cannot be written to (closed, its reader gone) loses the rest."""
    while data:
        try:
            data = data[os.write(fd, data) :]
        except InterruptedError:
            continue
        except OSError:
            return


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Within the block a stop's signal does all but interrupt: its line is printed and the
    started processes are ended at once, and `Stopped` is raised when the block ends. For a
    write to a database: an MLflow store on SQLite cut in the middle of one kept its write
    lock, and the clean-up's own writes (marking the runs stopped) then waited on it for
    20 s at a time and failed."""
    _held.append(True)
    try:
        yield
    finally:
        _held.pop()
    if not _held and _deferred:
        raise Stopped(_deferred.pop())


@contextlib.contextmanager
def stop_on_signals(say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM stop the program as described above. `say`
    prints the one line a person sees for each signal: it runs in the signal handler, so it
    must take no lock the interrupted code may hold (`write_line_to_stderr`; a `print` inside
    a Prefect flow goes through the run's loggers and their queues)."""

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if _stop_signal:
            say(f"{name}: already stopping; the started processes are being ended")
            return
        _stop_signal.append(signum)
        say(f"{name}: stopping; ending the started processes and marking the runs as stopped "
            "(run the same command again to resume)")  # fmt: skip
        _terminate_groups()
        if _held:
            _deferred.append(signum)
            return
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if not _stop_signal:  # once stopping, later signals keep meeting "already stopping"
            for sig, handler in previous.items():
                signal.signal(sig, handler)
