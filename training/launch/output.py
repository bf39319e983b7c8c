"""What a job's output says: the lines worth showing a person, and which rank caused a
failure (torchrun's report), as one `TrainingFailed`."""

from __future__ import annotations

import re
import signal
from pathlib import Path

FAILURE_RECORD = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class TrainingFailed(RuntimeError):
    def __init__(self, message: str, rank: int | None, exit_code: int) -> None:
        super().__init__(message)
        self.rank, self.exit_code = rank, exit_code


# torchrun's tee prefixes a worker's lines with "[default<local rank>]:", and torch's
# distributed logging adds "[rank<N>]:".
_PREFIX = r"^(?:\[default\d+\]:)?(?:\[rank\d+\]:)?"
_NOISE = re.compile(_PREFIX + r"""(?:
    [WI]\d{4}\ [\d:.]+\ +\d+\            # torch's glog-style warnings and infos: "W1124 19:22:55.384000 12062 ..."
  | \[[WI]\d{4}\ [\d:.]+\ [\w.]+:\d+\]  # c10d's: "[W1125 02:58:35.312868937 socket.cpp:207] ..."
  | (?:WARNING|INFO):(?!(?:training|ingestion|evaluation|flows)[.:])[\w.]+:  # library loggers: "WARNING:torchrec...:"
)""", re.VERBOSE)  # fmt: skip
# Python's warnings from installed packages: "/.../site-packages/pkg/mod.py:552: FutureWarning: ...",
# followed by the warning's source line, indented
_LIBRARY_WARNING = re.compile(_PREFIX + r"\S*[/\\](?:site|dist)-packages[/\\]\S+\.py:\d+: \w*Warning: ")


class ConsoleFilter:
    """Which lines of a job's output a person wants: everything (our workers' `[train]`
    lines, tracebacks, torchrun's failure report, anything unexpected) except the warnings
    that installed libraries print on every run (deprecations, planner notices)."""

    def __init__(self) -> None:
        self._after_warning: set[str] = set()  # the prefixes whose last line was a library warning

    def __call__(self, line: str) -> bool:
        prefix = re.match(_PREFIX, line)
        source = prefix.group(0) if prefix else ""
        if _LIBRARY_WARNING.match(line):
            self._after_warning.add(source)
            return False
        if source in self._after_warning:
            self._after_warning.discard(source)
            if line[len(source):].startswith(" "):
                return False  # the warning's source line
        return not _NOISE.match(line)


def first_cause(output: str) -> tuple[int, int, int] | None:
    """(rank, local rank, exit code) of the worker that caused a failure, from torchrun's report.

    torchrun lists every worker that ended badly, and its "first observed failure" is only
    the first it noticed. What each exit code says of its cause (`blame`, lowest first):
    - killed by SIGKILL, or crashed (SIGSEGV, SIGBUS, SIGILL, SIGFPE): no peer causes these;
      a SIGKILL comes from outside (a user, the OOM killer);
    - raised an exception: its own error, or a peer's death seen as a broken connection
      in a collective, which is why a killed peer ranks first;
    - another signal: SIGABRT is how NCCL's watchdog ends the survivors of a dead peer;
    - SIGTERM: torchrun stopping the survivors once one worker failed.
    Ties go to torchrun's first observed failure, then to the report's order.
    """
    root_at = output.find("Root Cause")
    failures = [(int(m[1]), int(m[2]), int(m[3]), 0 if 0 <= root_at < m.start() else 1)
                for m in FAILURE_RECORD.finditer(output)]  # fmt: skip
    if not failures:
        return None
    rank, local_rank, code, _ = min(failures, key=lambda failure: (blame(failure[2]), failure[3]))
    return rank, local_rank, code


SELF_INFLICTED = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def blame(exit_code: int) -> int:
    """How likely a worker that ended with `exit_code` (negative: killed by that signal)
    caused the failure: 0 most likely; see `first_cause`."""
    if exit_code > 0:
        return 1
    if -exit_code in SELF_INFLICTED:
        return 0
    return 3 if exit_code == -signal.SIGTERM else 2


def failure_of(output: str, launcher_code: int, logs: Path) -> TrainingFailed:
    """The failure a launch ended with, from its output and its ranks' logs (one message)."""
    cause = first_cause(output)
    if cause is None:
        tail = "\n".join(output.strip().splitlines()[-15:])
        return TrainingFailed(f"training failed (torchrun exit code {launcher_code}):\n{tail}", None, launcher_code)
    rank, local_rank, code = cause
    if code < 0:
        # A signal leaves no traceback: the process was stopped from outside.
        name = signal.Signals(-code).name
        message = f"training failed: rank {rank} was killed by {name} (no traceback: stopped from outside, "
        message += "e.g. by the out-of-memory killer or an operator)"
        return TrainingFailed(message, rank, code)
    tail = _rank_log_tail(logs, local_rank) or _traceback_from(output, rank)
    message = f"training failed: rank {rank} exited with code {code}"
    if tail:
        message += f"; the end of its log:\n{tail}"
    return TrainingFailed(message, rank, code)


def _rank_log_tail(log_dir: Path, local_rank: int, lines: int = 15) -> str:
    """The last lines of a rank's stderr from torchrun's log folder, if it wrote any."""
    candidates = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        return ""
    text = [ln for ln in candidates[-1].read_text(errors="replace").splitlines() if "Warning" not in ln]
    return "\n".join(text[-lines:])


def _traceback_from(output: str, rank: int) -> str:
    prefix = f"[rank{rank}]:"
    lines = [ln[len(prefix):] for ln in output.splitlines() if ln.startswith(prefix)]
    return "\n".join(lines[-15:])
