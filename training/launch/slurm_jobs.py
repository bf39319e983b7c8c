"""Training as a Slurm batch job: the script (kept in the run folder, readable and editable),
its submission with `sbatch`, its state from `scontrol`, and `scancel`.

The script runs `dlrm train` once a node under `srun`; each node takes its place from the
allocation (training/launch/slurm.py). Every node writes its own log, `%j-node%n.out` beside
the script (`%n`: the node's index), and node 0's log ends with the job's report, one JSON
line. `--requeue` is set: a job that Slurm requeues (a node lost, `scontrol requeue`) runs the
same command again and resumes from its last checkpoint, as a relaunch by hand does.
`scontrol` answers without Slurm's accounting database, for as long as the controller keeps
the finished job (`MinJobAge`, 300 s by default).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

# States after which a job runs no more (squeue's long names, as scontrol writes them)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY"}  # fmt: skip


class SlurmJobError(RuntimeError):
    """sbatch, scontrol or scancel refused; the message says what Slurm said."""


@dataclass(frozen=True)
class BatchRequest:
    """What `dlrm submit` asks Slurm for, and the command each node runs."""

    job_name: str
    command: tuple[str, ...]  # `dlrm train …`, run once a node
    workdir: str  # where the command runs (the project)
    nodes: int = 1
    partition: str = ""
    time_limit: str = ""
    gpus_per_node: int = 0
    extra: tuple[str, ...] = ()  # further `#SBATCH` arguments, as written
    written_by: str = "`dlrm submit`"  # for the script's first comment

    def script(self, log_dir: Path) -> str:
        """The batch script."""
        options = [f"--job-name={self.job_name}", f"--nodes={self.nodes}", "--ntasks-per-node=1", "--requeue",
                   f"--output={log_dir}/%j.out", "--open-mode=append"]  # fmt: skip
        options += [f"--partition={self.partition}"] * bool(self.partition)
        options += [f"--time={self.time_limit}"] * bool(self.time_limit)
        options += [f"--gpus-per-node={self.gpus_per_node}"] * bool(self.gpus_per_node)
        options += list(self.extra)
        node_log = f"{log_dir}/%j-node%n.out"
        return "\n".join([
            "#!/bin/bash",
            f"# Written by {self.written_by}; submit it again with `sbatch` (edits kept).",
            *(f"#SBATCH {option}" for option in options),
            "set -euo pipefail",
            f"cd {shlex.quote(self.workdir)}",
            "# A requeued job numbers its steps from 0 again, and the controller may still owe a node",
            "# a signal for the last run's step (one it could not reach, such as a lost node's: it retries",
            "# a minute later). Each run's training takes a step of its own: run N starts N empty steps first.",
            'for _ in $(seq "${SLURM_RESTART_COUNT:-0}"); do srun --nodes=1 --ntasks=1 --output=/dev/null true || true; done',
            "# one training command a node; each takes its place in the job from Slurm's environment",
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append --output={shlex.quote(node_log)} "
            + " ".join(shlex.quote(part) for part in self.command),
            "",
        ])  # fmt: skip


def write_script(request: BatchRequest, folder: Path) -> Path:
    """The request's batch script, written into `folder` (the nodes' logs go beside it):
    `<folder>/<job name>-<time>.sbatch`."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / f"{request.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    script.write_text(request.script(folder))
    return script


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, …
    exit_code: str = ""  # "0:0": the exit status and the signal
    reason: str = ""  # Slurm's reason (why pending, or why it failed)
    restarts: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    lost_nodes: tuple[str, ...] = ()  # after a requeue or a node failure: the job's nodes Slurm has down

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def nodes(self) -> str:
        """The nodes the job holds (a host-list expression); empty while it holds none."""
        nodelist = self.fields.get("NodeList", "")
        return "" if nodelist in ("", "(null)") else nodelist

    def said(self) -> str:
        """The state as a person reads it: `RUNNING`, `PENDING (BeginTime), restart 1: node n1 lost (…)`."""
        why = f" ({self.reason})" if self.reason not in ("", "None") else ""
        again = f", restart {self.restarts}" if self.restarts else ""
        lost = f": {'; '.join(self.lost_nodes)}" if self.lost_nodes else ""
        return f"{self.state}{why}{again}{lost}"


Run = Callable[[Sequence[str]], subprocess.CompletedProcess]


def _said(done: subprocess.CompletedProcess) -> str:
    """What a Slurm command said, as one line (its `sbatch: error:` prefixes dropped)."""
    lines = [re.sub(r"^\w+: error: ", "", line.strip()) for line in (done.stderr or done.stdout).splitlines()]
    return "; ".join(line for line in lines if line)


def run_slurm(argv: Sequence[str]) -> subprocess.CompletedProcess:
    """A Slurm command's answer (a missing command: one line saying where to run)."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise SlurmJobError(f"{argv[0]}: not found; run this on a Slurm login node (or install Slurm's client "
                            "commands)") from None  # fmt: skip


def submit(script: Path, run: Run = run_slurm) -> str:
    """`sbatch` the script; its job id."""
    done = run(["sbatch", "--parsable", str(script)])
    if done.returncode:
        raise SlurmJobError(f"sbatch {script}: {_said(done)}")
    return done.stdout.strip().split(";")[0]


def job_state(job_id: str, run: Run = run_slurm) -> JobState:
    """The job as `scontrol show job` tells it."""
    done = run(["scontrol", "show", "job", "--oneliner", job_id])
    if done.returncode:
        raise SlurmJobError(f"scontrol show job {job_id}: {_said(done)} (the controller "
                            "forgets a job MinJobAge seconds after it ends)")  # fmt: skip
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    return JobState(job_id, fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", ""),
                    fields.get("Reason", "None"), int(fields.get("Restarts", "0") or 0), fields)  # fmt: skip


def cancel(job_id: str, run: Run = run_slurm) -> None:
    done = run(["scancel", job_id])
    if done.returncode:
        raise SlurmJobError(f"scancel {job_id}: {_said(done)}")


def lost_nodes(nodelist: str, run: Run = run_slurm) -> tuple[str, ...]:
    """Of the nodes in `nodelist`, those Slurm has down, drained, failing or not responding,
    each as `node NAME STATE (reason)`."""
    done = run(["scontrol", "show", "node", "--oneliner", nodelist])
    if done.returncode:
        return ()
    lost = []
    for line in done.stdout.splitlines():
        name, state = re.search(r"NodeName=(\S+)", line), re.search(r"\bState=(\S+)", line)
        if name is None or state is None:
            continue
        if any(word in state[1] for word in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING")):
            reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?\s*$", line)
            lost.append(f"node {name[1]} {state[1]}" + (f" ({reason[1]})" if reason and reason[1] else ""))
    return tuple(lost)


def follow(job_id: str, on_change: Callable[[JobState], None], poll_s: float = 2.0, run: Run = run_slurm,
           on_tick: Callable[[], None] | None = None) -> JobState:  # fmt: skip
    """Wait for the job to end, telling each change of state; its last state. After a
    requeue, or a job ended by a node failure, the state names the nodes Slurm lost.
    `on_tick` is called at every poll while the job has not ended (what it raises ends the
    wait: the caller cancels the job)."""
    seen: tuple[str, int] | None = None
    held = ""  # the nodes the job last held: after a requeue Slurm no longer says which
    while True:
        state = job_state(job_id, run)
        if (state.state, state.restarts) != seen:
            if seen is not None and held and (state.restarts > seen[1] or state.state == "NODE_FAIL"):
                state = replace(state, lost_nodes=lost_nodes(held, run))
            seen = (state.state, state.restarts)
            on_change(state)
        held = state.nodes or held
        if state.ended:
            return state
        if on_tick is not None:
            on_tick()
        time.sleep(poll_s)
