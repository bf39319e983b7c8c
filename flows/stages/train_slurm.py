"""The pipeline's training stage as a Slurm batch job (`orchestration.launcher = "slurm"`), and
a study's validation runs the same way (`train_where_configured`).

The flow runs on a head (login) node; the stage writes the job into the shared run folder,
submits a batch script of `orchestration.trainer_hosts` nodes to `<run_dir>/slurm/` (one
`python -m training.launch.slurm_node JOB` a node under `srun`, `--requeue`), follows it
with `scontrol` and reads node 0's summary from the folder once Slurm says it completed.

A job that Slurm fails, cancels or times out fails the stage with the job id, its state,
Slurm's reason and node 0's log; the stage's retry submits again and resumes from the
checkpoint (training/launch/resume.py). A stop of the stage (the flow run cancelled, Ctrl-C
on `dlrm run`) cancels the job. The job's scheduling is Slurm's: it may pend for as long as
the cluster is full.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from flows.run.config import PipelineConfig, SlurmJobConfig
from training.job import TrainJob
from training.launch.launcher import TrainingFailed, launch
from training.launch.slurm_jobs import BatchRequest, Run, SlurmJobError, cancel, follow, run_slurm, submit, write_script
from training.loop.progress import MetricsFollower, MetricsRecord

PROJECT = Path(__file__).resolve().parents[2]


def batch_request(job_file: Path, hosts: int, name: str, slurm: SlurmJobConfig,
                  what: str = "the pipeline's training stage") -> BatchRequest:  # fmt: skip
    """The batch job that runs `job_file` on `hosts` nodes, as `slurm` asks; `what` says in the
    script what submitted it."""
    command = (sys.executable, "-m", "training.launch.slurm_node", str(job_file))
    return BatchRequest(f"dlrm-{name}", command, str(PROJECT), hosts, slurm.partition, slurm.time_limit,
                        slurm.gpus_per_node, tuple(slurm.sbatch_args), what)  # fmt: skip


def train_where_configured(config: PipelineConfig, job: TrainJob, name: str, say: Callable[[str], None],
                           on_progress: Callable[[MetricsRecord], None] | None = None) -> str:  # fmt: skip
    """Run `job` where `orchestration.launcher` says: on this host, or as a Slurm batch job
    named `name` (a study's trials and comparison runs train where the pipeline's run does).
    What `on_progress` raises stops the job (a pruned trial: the Slurm job is cancelled).
    The Slurm job id, or "" on this host."""
    if config.orchestration.launcher == "slurm":
        return train_on_slurm(job, config.orchestration.slurm, name, config.path("slurm"), say, on_progress=on_progress,
                              what="a study's validation run (dlrm retune)")  # fmt: skip
    launch(job, on_line=say, on_progress=on_progress)
    return ""


def train_on_slurm(job: TrainJob, slurm: SlurmJobConfig, name: str, scripts: Path, say: Callable[[str], None],
                   run: Run = run_slurm, on_progress: Callable[[MetricsRecord], None] | None = None,
                   what: str = "the pipeline's training stage") -> str:  # fmt: skip
    """Run `job` as a Slurm batch job and wait for it; its job id once it completed. `run`
    runs Slurm's commands (sbatch, scontrol, scancel); `on_progress` gets each record of the
    job's metrics file (in the shared run folder) as it is written, while the job runs and
    once more when it has completed."""
    job.out.mkdir(parents=True, exist_ok=True)
    job_file = job.folder.hosts_job_file  # in the shared run folder: every node reads this one job
    job.save(job_file)
    script = write_script(batch_request(job_file, job.hosts, name, slurm, what), scripts)
    try:
        job_id = submit(script, run)
    except SlurmJobError as refused:
        raise TrainingFailed(f"{refused} (the script: {script})", None, 1) from None
    node0_log = scripts / f"{job_id}-node0.out"
    say(f"[train] Slurm job {job_id} submitted ({job.hosts} node(s), {script}); node logs {scripts}/{job_id}-node*.out")

    metrics = MetricsFollower(job.folder.metrics)

    def read_progress() -> None:
        for record in metrics.read_new() if on_progress is not None else ():
            on_progress(record)

    try:
        final = follow(job_id, lambda state: say(f"[train] Slurm job {job_id}: {state.said()}"), poll_s=slurm.poll_s,
                       run=run, on_tick=read_progress)  # fmt: skip
        if final.state == "COMPLETED":
            read_progress()  # what the job wrote since the last poll
    except BaseException:  # a stop of the stage, or Slurm no longer answering: no job left running
        with contextlib.suppress(SlurmJobError):
            cancel(job_id, run)
        say(f"[train] Slurm job {job_id} cancelled (scancel)")
        raise
    if final.state != "COMPLETED":
        lost = f"; {'; '.join(final.lost_nodes)}" if final.lost_nodes else ""
        raise TrainingFailed(f"Slurm job {job_id} ended {final.state} (reason {final.reason}, exit code "
                             f"{final.exit_code}){lost}; node 0's log: {node0_log}", None, 1)  # fmt: skip
    return job_id
