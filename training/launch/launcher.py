"""Launch a training job with torchrun as a subprocess and surface failures clearly.

torchrun starts `nproc` workers (`training.launch.rank`, which runs `training.worker`), tees
each rank's output into the job folder's logs, and on failure prints which rank died first. The launcher streams the output,
less the libraries' warnings, to `on_line` (so a Prefect task logs progress live), hands the
records of the job's metrics file to `on_progress` as they are written (progress, held-out
NE: what a program acts on, e.g. a pruner), and turns a failure into one `TrainingFailed`
naming the rank, its exit code (or signal) and the end of its traceback (launch/output.py).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from training.job import JobFolder, TrainJob
from training.launch.device import check_one_process_per_gpu
from training.launch.host_role import HostRole
from training.launch.output import ConsoleFilter, TrainingFailed, failure_of
from training.launch.processes import forget_group, raise_if_stopped, start_group, stop_group
from training.launch.resume import mark_finished, prepare_checkpoints
from training.launch.warm_ranks import client_command, keeps_torchrun, server_socket
from training.loop.checkpoint_chain import latest_checkpoint
from training.loop.progress import MetricsFollower, MetricsRecord

__all__ = ["AGENT_MODULE", "RANK_MODULE", "PeerFailed", "TrainingFailed", "launch", "torchrun_command"]

RANK_MODULE = "training.launch.rank"  # what torchrun starts on each rank
AGENT_MODULE = "training.launch.agent"  # torchrun itself (torch.distributed.run, imported faster)


def torchrun_command(job: TrainJob, job_path: Path, role: HostRole | None = None) -> list[str]:
    """torchrun for this host: alone (`--standalone`), or its part of a multi-host job."""
    config = job.training
    return [
        sys.executable, "-m", AGENT_MODULE,
        *(role.torchrun_args() if role is not None else ["--standalone"]),
        f"--nproc-per-node={config.nproc}",
        "--max-restarts=0",  # restarts are fresh launches, see `launch`
        f"--log-dir={job.folder.logs(_node(role))}",
        "--tee=3",
        *config.torchrun_args,
        "-m", RANK_MODULE, str(job_path),
    ]  # fmt: skip


def _node(role: HostRole | None) -> int | None:
    return role.node_rank if role is not None else None


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
    each record of the job's metrics file (`training.loop.progress`), checked as output arrives
    and at least every `poll_s` seconds. An exception raised by either callback stops the
    job (every worker) and propagates: that is how a pruned trial ends early.

    A failed attempt is relaunched as a fresh torchrun (a new rendezvous) up to
    `training.max_restarts` times; each relaunch resumes from the run's last checkpoint.
    A new launch of an interrupted job resumes too; of a finished one, trains again
    (training/launch/resume.py).
    torchrun's own in-place restart is not used: with gloo it can rejoin a dead peer's
    stale address and hang.
    """
    if job.hosts != (role.nnodes if role is not None else 1):
        this = f"node {role.node_rank} of {role.nnodes}" if role else "one host"
        raise TrainingFailed(f"the job spans {job.hosts} host(s), but this launch is {this}", None, 2)
    check_one_process_per_gpu(job.training.nproc, job.training.device)
    poll = _progress_poller(MetricsFollower(job.folder.metrics), on_progress)
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


# What each host of a failed job says should not depend on which host wrote its failure
# first: the ranks of every host fail within milliseconds of one another once one is gone. A
# host that sees another host's failure gives its own torchrun this long to end on its own
# before stopping it (one still running then waits in a collective for a peer that is gone);
# a host whose ranks failed gives the other hosts this long to say why, unless one of its own
# was killed from outside (an operator, the out-of-memory killer): that is the cause.
PEER_GRACE_S = 3.0


def _saying_where(failure: PeerFailed, where: str) -> PeerFailed:
    failure.args = (f"{failure} ({where}; run the same command on every host to resume)",)
    return failure


def _peer_failure_within(folder: JobFolder, role: HostRole, seconds: float) -> str | None:
    """Another host's failure, once one is written or `seconds` have passed (None then)."""
    deadline = time.monotonic() + seconds
    while (failure := folder.peer_failure(role.node_rank, role.nnodes)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return failure


def _killed_from_outside(failure: TrainingFailed) -> bool:
    """A rank ended by a signal other than torchrun's own stop of the others (SIGTERM): a
    cause of a job's failure, never a consequence of another host's."""
    return failure.exit_code < 0 and failure.exit_code != -signal.SIGTERM


def _launch_on_hosts(job: TrainJob, on_line: Callable[[str], None], poll: Callable[[], None], poll_s: float,
                     role: HostRole) -> None:  # fmt: skip
    """One attempt of this host's part: a failure anywhere fails every host (the failure
    marks of `JobFolder`)."""
    folder = job.folder
    folder.clear_failure(role.node_rank)
    if role.leads:
        on_line(f"[train] {prepare_checkpoints(job)}")
    started = folder.logs(role.node_rank)
    seen: list[float] = []  # when this host first saw another host's failure

    def peer_failed(failure: str) -> PeerFailed:
        return PeerFailed(f"training failed on another host ({failure}); this host stopped its part", None, 1)

    def poll_and_watch_peers() -> None:
        poll()
        if not any(started.glob("*/attempt_*")):
            return
        if (failure := folder.peer_failure(role.node_rank, role.nnodes)) is not None:
            seen[:] = seen or [time.monotonic()]
            if time.monotonic() - seen[0] >= PEER_GRACE_S:
                raise peer_failed(failure)

    def stopped_here(stop: BaseException) -> None:  # said before this host's ranks are stopped
        if isinstance(stop, KeyboardInterrupt):
            folder.record_failure(role.node_rank, "stopped by a signal")

    where = f"node {role.node_rank} of {role.nnodes}"
    try:
        _launch_once(job, on_line, poll_and_watch_peers, poll_s, role, before_stop=stopped_here)
        if (failure := folder.peer_failure(role.node_rank, role.nnodes)) is not None:
            raise peer_failed(failure)  # this host's part ended well within the grace; the job did not
    except PeerFailed as failure:
        _saying_where(failure, where)
        raise
    except TrainingFailed as failure:
        peer = None if _killed_from_outside(failure) else _peer_failure_within(folder, role, PEER_GRACE_S)
        if peer is not None:  # its ranks failed after, and because of, the other host's
            raise _saying_where(peer_failed(peer), where) from failure
        folder.record_failure(role.node_rank, str(failure).splitlines()[0])
        resume = f"{where}; run the same command on every host to resume from the last checkpoint"
        failure.args = (f"{failure} ({resume})",)
        raise
    except KeyboardInterrupt:  # stopped here (Ctrl-C, SIGTERM): the other hosts stop too
        folder.record_failure(role.node_rank, "stopped by a signal")
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
                 role: HostRole | None = None, before_stop: Callable[[BaseException], None] = lambda stop: None,
                 ) -> None:  # fmt: skip
    job.out.mkdir(parents=True, exist_ok=True)
    # Checkpoints, and the metrics of the steps they hold, stay: a relaunch of the same run
    # resumes from them. What the hosts share is node 0's to clear.
    leads = role is None or role.leads
    job.folder.clear_for_launch(_node(role), leads, fresh=latest_checkpoint(job.checkpoint_root) is None)
    job_path = job.folder.job_file(_node(role))
    job.save(job_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(job.training.threads_per_proc), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_project_root()), env.get("PYTHONPATH")]))
    env.update(role.environment() if role is not None else {})
    # Its own process group (a stop reaches every worker), ended with this process: killed
    # outright if this process dies first, since torchrun's SIGTERM shutdown without its
    # parent was seen to hang for good beside a defunct worker (its workers die with it:
    # training/worker.py).
    process = start_group(_command(job, job_path, role), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env, death_signal=signal.SIGKILL)  # fmt: skip
    try:
        output = follow(process, on_line, poll, poll_s)
    except BaseException as stop:
        # A callback stopped the job (a pruned trial), or Ctrl-C: no orphaned workers.
        before_stop(stop)
        stop_group(process)
        raise
    code = process.wait()
    forget_group(process)
    raise_if_stopped()  # ended by a stop (SIGINT/SIGTERM to the program): not a failure to retry
    if code != 0:
        raise failure_of("\n".join(output), code, job.folder.logs(_node(role)))


def _command(job: TrainJob, job_path: Path, role: HostRole | None) -> list[str]:
    """torchrun, or on one host with a warm-rank server named (`DLRM_WARM_RANKS`), the
    client that has the server fork the ranks (training/launch/warm_ranks.py), unless the
    job is to keep torchrun (`DLRM_WARM_RANKS_UNDER_TORCHRUN`: the server forks its ranks)."""
    server = server_socket() if role is None and not keeps_torchrun() else None
    if server is None:
        return torchrun_command(job, job_path, role)
    return client_command(server, job_path, job.training.nproc, job.folder.logs(None))


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
    return Path(__file__).resolve().parents[2]
