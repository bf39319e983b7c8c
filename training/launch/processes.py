"""Child process groups that end with the program that started them, and a stop on SIGINT
or SIGTERM that reaches every one of them.

A job's torchrun and a temporary Prefect server run in their own sessions, so a Ctrl-C in
the terminal reaches only the `dlrm` process: it then decides the order of the stop (end
the training, mark the runs, stop the server last), instead of every process dying at once
and the survivors failing against a dead API. Each group is also tied to its parent's life
(Linux's parent-death signal): a parent killed outright (SIGKILL) leaves no orphan.

The first SIGINT or SIGTERM raises `Stopped` in the main thread and terminates every
registered group; later ones only say that the stop is under way, so a second Ctrl-C cannot
interrupt the clean-up and leave orphans.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1
_groups: set[int] = set()
_lock = threading.Lock()
_stop_signal: list[int] = []  # the signal that asked for the stop; empty while none has


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


def start_group(command: Sequence[str], *, end_on_stop: bool = True, **popen: Any) -> subprocess.Popen:
    """Start `command` as the leader of a new session, tied to this process's life.

    `end_on_stop`: a stop terminates the group at once (work: a training job). A service
    the clean-up still needs (the Prefect API that the runs are marked through) passes
    False and is stopped by its owner, last."""
    raise_if_stopped()  # a stop that came first must not be followed by a new child
    process = subprocess.Popen(_tied_to_this_process(command), start_new_session=True, **popen)
    if end_on_stop:
        with _lock:
            _groups.add(process.pid)
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


# Run first in the child: ask for SIGTERM when the parent dies (it survives the exec), give
# up if the parent is already gone, then become the command. A trampoline rather than
# `preexec_fn`, which is unsafe in a threaded parent (Prefect's and the heartbeat's threads).
_TRAMPOLINE = (
    f"import ctypes, os, sys; ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGTERM)}, 0, 0, 0); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(143); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _tied_to_this_process(command: Sequence[str]) -> list[str]:
    """`command`, started through the trampoline on Linux (elsewhere the explicit stop is
    the only guard)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *command]


def _terminate_groups() -> None:
    with _lock:
        groups = list(_groups)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals(say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM stop the program as described above. `say`
    prints the one line a person sees for each signal."""

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if _stop_signal:
            say(f"{name}: already stopping; the started processes are being ended")
            return
        _stop_signal.append(signum)
        say(f"{name}: stopping; ending the started processes and marking the runs as stopped "
            "(run the same command again to resume)")  # fmt: skip
        _terminate_groups()
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if not _stop_signal:  # once stopping, later signals keep meeting "already stopping"
            for sig, handler in previous.items():
                signal.signal(sig, handler)
