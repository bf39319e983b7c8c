"""Launch a training job with torchrun as a subprocess and surface failures clearly.

torchrun starts `nproc` workers (`training.worker`), tees each rank's output into
`<out>/logs/`, and on failure prints which rank died first. The launcher streams the output,
less the libraries' warnings, to `on_line` (so a Prefect task logs progress live), hands the
records of the job's metrics file to `on_progress` as they are written (progress, held-out
NE: what a program acts on, e.g. a pruner), and turns a failure into one `TrainingFailed`
naming the rank, its exit code (or signal) and the end of its traceback.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from training.checkpoint import latest_checkpoint
from training.hosts import HostRole, clear_failure, peer_failure, record_failure
from training.job import TrainJob
from training.processes import forget_group, raise_if_stopped, start_group, stop_group
from training.progress import MetricsFollower, MetricsRecord
from training.resume import mark_finished, prepare_checkpoints

FAILURE_RECORD = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class TrainingFailed(RuntimeError):
    def __init__(self, message: str, rank: int | None, exit_code: int) -> None:
        super().__init__(message)
        self.rank, self.exit_code = rank, exit_code


def torchrun_command(job: TrainJob, job_path: Path, role: HostRole | None = None) -> list[str]:
    """torchrun for this host: alone (`--standalone`), or its part of a multi-host job."""
    config = job.training
    multi_node = role is not None or any(arg.startswith(("--nnodes", "--rdzv")) for arg in config.torchrun_args)
    return [
        sys.executable, "-m", "torch.distributed.run",
        *([] if multi_node else ["--standalone"]),
        *(role.torchrun_args() if role is not None else []),
        f"--nproc-per-node={config.nproc}",
        "--max-restarts=0",  # restarts are fresh launches, see `launch`
        f"--log-dir={log_dir(job, role)}",
        "--tee=3",
        *config.torchrun_args,
        "-m", "training.worker", str(job_path),
    ]  # fmt: skip


def log_dir(job: TrainJob, role: HostRole | None = None) -> Path:
    """torchrun's per-rank logs; each host its own folder of a shared run folder."""
    return job.out / "logs" / f"node-{role.node_rank}" if role is not None else job.out / "logs"


def launch(
    job: TrainJob,
    on_line: Callable[[str], None] = print,
    on_progress: Callable[[MetricsRecord], None] | None = None,
    poll_s: float = 1.0,
    role: HostRole | None = None,
) -> None:
    """Run the job to completion; raise `TrainingFailed` if it still fails after its restarts.

    `role`: this host's part of a multi-host job. Every host writes into the same (shared)
    `job.out`; node 0 alone prepares and clears what the hosts share (checkpoint folders,
    predictions, the summary). A multi-host job is never relaunched on one host (a lone
    torchrun would wait for peers that have stopped): it fails, and the same command on
    every host resumes it.

    `on_line` gets the output worth showing a person (`ConsoleFilter`); `on_progress` gets
    each record of the job's metrics file (`training.progress`), checked as output arrives
    and at least every `poll_s` seconds. An exception raised by either callback stops the
    job (every worker) and propagates: that is how a pruned trial ends early.

    A failed attempt is relaunched as a fresh torchrun (a new rendezvous) up to
    `training.max_restarts` times; each relaunch resumes from the run's last checkpoint.
    A new launch of an interrupted job resumes too; of a finished one, trains again
    (training/resume.py).
    torchrun's own in-place restart is not used: with gloo it can rejoin a dead peer's
    stale address and hang.
    """
    poll = _progress_poller(MetricsFollower(job.out / "metrics.jsonl"), on_progress)
    if role is not None and role.nnodes > 1:
        _launch_on_hosts(job, on_line, poll, poll_s, role)
        return
    attempts = job.training.max_restarts + 1
    on_line(f"[train] {prepare_checkpoints(job)}")
    for attempt in range(1, attempts + 1):
        try:
            _launch_once(job, on_line, poll, poll_s)
            mark_finished(job)
            return
        except TrainingFailed as failure:
            if attempt == attempts:
                raise
            on_line(f"[train] {failure}")
            on_line(f"[train] relaunching (restart {attempt} of {job.training.max_restarts}); "
                    "it resumes from the last checkpoint")  # fmt: skip


class PeerFailed(TrainingFailed):
    """Another host of the job failed or was stopped; this host stopped its part too."""


def _launch_on_hosts(job: TrainJob, on_line: Callable[[str], None], poll: Callable[[], None], poll_s: float,
                     role: HostRole) -> None:  # fmt: skip
    """One attempt of this host's part: a failure anywhere fails every host (see `hosts`)."""
    marks = job.out / "logs"
    clear_failure(marks, role)
    if role.leads:
        on_line(f"[train] {prepare_checkpoints(job)}")
    started = log_dir(job, role)

    def poll_and_watch_peers() -> None:
        poll()
        if any(started.glob("*/attempt_*")) and (failure := peer_failure(marks, role)) is not None:
            raise PeerFailed(f"training failed on another host ({failure}); this host stopped its part", None, 1)

    where = f"node {role.node_rank} of {role.nnodes}"
    try:
        _launch_once(job, on_line, poll_and_watch_peers, poll_s, role)
    except PeerFailed as failure:
        failure.args = (f"{failure} ({where}; run the same command on every host to resume)",)
        raise
    except TrainingFailed as failure:
        record_failure(marks, role, str(failure).splitlines()[0])
        resume = f"{where}; run the same command on every host to resume from the last checkpoint"
        failure.args = (f"{failure} ({resume})",)
        raise
    except KeyboardInterrupt:  # stopped here (Ctrl-C, SIGTERM): the other hosts stop too
        record_failure(marks, role, "stopped by a signal")
        raise
    if role.leads:
        mark_finished(job)


def _progress_poller(metrics: MetricsFollower, on_progress: Callable[[MetricsRecord], None] | None
                     ) -> Callable[[], None]:  # fmt: skip
    """Hands the records appended since the last call to `on_progress` (across relaunches:
    a resumed run replaces the file, and its records are read again from the start)."""

    def poll() -> None:
        if on_progress is not None:
            for record in metrics.read_new():
                on_progress(record)

    return poll


def _launch_once(job: TrainJob, on_line: Callable[[str], None], poll: Callable[[], None], poll_s: float,
                 role: HostRole | None = None) -> None:  # fmt: skip
    job.out.mkdir(parents=True, exist_ok=True)
    # Checkpoints, and the metrics of the steps they hold, stay: a relaunch of the same run
    # resumes from them. Without a checkpoint the run starts at step 0, and any metrics
    # there are an earlier run's (the worker would drop them too; gone now, no reader sees them).
    stale = [log_dir(job, role)]
    if role is None or role.leads:  # what the hosts share is node 0's to clear
        stale += [job.out / "predictions", job.out / "summary.json"]
        if latest_checkpoint(job.checkpoint_root) is None:
            stale.append(job.out / "metrics.jsonl")
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    job_path = job.out / ("job.json" if role is None else f"job-node-{role.node_rank}.json")
    job.save(job_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(job.training.threads_per_proc), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_project_root()), env.get("PYTHONPATH")]))
    env.update(role.environment() if role is not None else {})
    # its own process group (a stop reaches every worker), ended with this process
    process = start_group(torchrun_command(job, job_path, role), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)  # fmt: skip
    try:
        output = follow(process, on_line, poll, poll_s)
    except BaseException:
        # A callback stopped the job (a pruned trial), or Ctrl-C: no orphaned workers.
        stop_group(process)
        raise
    code = process.wait()
    forget_group(process)
    raise_if_stopped()  # ended by a stop (SIGINT/SIGTERM to the program): not a failure to retry
    if code != 0:
        raise _failure("\n".join(output), code, log_dir(job, role))


def follow(process: subprocess.Popen, on_line: Callable[[str], None], poll: Callable[[], None],
           poll_s: float = 1.0) -> list[str]:  # fmt: skip
    """Stream `process`'s output until it ends: each line worth showing to `on_line`; `poll()`
    after each line and after every `poll_s` seconds without one, and once at the end.
    Returns every line (for the failure report)."""
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read(stdout) -> None:  # a thread: a silent job still gets polled
        for line in stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, args=(process.stdout,), name="launcher-output", daemon=True).start()
    shown, output = ConsoleFilter(), []
    while True:
        try:
            line = lines.get(timeout=poll_s)
        except queue.Empty:
            poll()
            continue
        if line is None:
            break
        line = line.rstrip("\n")
        output.append(line)
        if shown(line):
            on_line(line)
        poll()
    poll()
    return output


def _project_root() -> Path:
    return Path(__file__).resolve().parent.parent


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


def _failure(output: str, launcher_code: int, logs: Path) -> TrainingFailed:
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
