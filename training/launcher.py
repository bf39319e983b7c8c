"""Launch a training job with torchrun as a subprocess and surface failures clearly.

torchrun starts `nproc` workers (`training.worker`), tees each rank's output into
`<out>/logs/`, and on failure prints which rank died first. The launcher streams the output
to a callback (so a Prefect task logs progress live) and turns a failure into one
`TrainingFailed` naming the rank, its exit code (or signal) and the end of its traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from training.job import TrainJob

FAILURE_RECORD = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class TrainingFailed(RuntimeError):
    def __init__(self, message: str, rank: int | None, exit_code: int) -> None:
        super().__init__(message)
        self.rank, self.exit_code = rank, exit_code


def torchrun_command(job: TrainJob, job_path: Path) -> list[str]:
    config = job.training
    multi_node = any(arg.startswith(("--nnodes", "--rdzv")) for arg in config.torchrun_args)
    return [
        sys.executable, "-m", "torch.distributed.run",
        *([] if multi_node else ["--standalone"]),
        f"--nproc-per-node={config.nproc}",
        "--max-restarts=0",  # restarts are fresh launches, see `launch`
        f"--log-dir={job.out / 'logs'}",
        "--tee=3",
        *config.torchrun_args,
        "-m", "training.worker", str(job_path),
    ]  # fmt: skip


def launch(job: TrainJob, on_line: Callable[[str], None] = print) -> None:
    """Run the job to completion; raise `TrainingFailed` if it still fails after its restarts.

    A failed attempt is relaunched as a fresh torchrun (a new rendezvous) up to
    `training.max_restarts` times; each relaunch resumes from the run's last checkpoint.
    torchrun's own in-place restart is not used: with gloo it can rejoin a dead peer's
    stale address and hang.
    """
    attempts = job.training.max_restarts + 1
    for attempt in range(1, attempts + 1):
        try:
            _launch_once(job, on_line)
            return
        except TrainingFailed as failure:
            if attempt == attempts:
                raise
            on_line(f"[train] {failure}")
            on_line(f"[train] relaunching (restart {attempt} of {job.training.max_restarts}); "
                    "it resumes from the last checkpoint")  # fmt: skip


def _launch_once(job: TrainJob, on_line: Callable[[str], None]) -> None:
    job.out.mkdir(parents=True, exist_ok=True)
    # Checkpoints and metrics stay: a relaunch of the same run resumes from them.
    for stale in ("logs", "predictions", "summary.json"):
        path = job.out / stale
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    job_path = job.out / "job.json"
    job.save(job_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(job.training.threads_per_proc), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_project_root()), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        torchrun_command(job, job_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # its own process group, so a stop reaches every worker
    )  # fmt: skip
    output: list[str] = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            line = line.rstrip("\n")
            output.append(line)
            if _worth_showing(line):
                on_line(line)
    except BaseException:
        # The caller stopped the job (a pruned trial, Ctrl-C): no orphaned workers.
        _stop(process)
        raise
    code = process.wait()
    if code != 0:
        raise _failure(job, "\n".join(output), code)


def _stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _project_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _worth_showing(line: str) -> bool:
    """Progress and errors; not the libraries' warnings."""
    return "[train]" in line or "Error" in line or "Traceback" in line


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


def _failure(job: TrainJob, output: str, launcher_code: int) -> TrainingFailed:
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
    tail = _rank_log_tail(job.out / "logs", local_rank) or _traceback_from(output, rank)
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
