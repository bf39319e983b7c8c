"""One node's part of a training job the pipeline submitted to Slurm:

    srun --ntasks-per-node=1 python -m training.launch.slurm_node <run_dir>/train/job-hosts.json

The pipeline's training stage (`orchestration.launcher = "slurm"`) writes the job into the
shared run folder and submits a batch script that runs this on every node. Each node takes
its place from the allocation (training/launch/slurm.py) and launches its processes as
`dlrm train` on several hosts does; node 0 writes the job's summary, which the stage reads
back once Slurm says the job completed. A node count other than the job's is refused in one
line, before anything starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from training.job import TrainJob
from training.launch.host_role import HostRole
from training.launch.launcher import TrainingFailed, launch
from training.launch.processes import Stopped, stop_on_signals, write_line_to_stderr
from training.launch.slurm import SlurmError, slurm_allocation


def node_role(job: TrainJob, environ: Mapping[str, str]) -> HostRole | None:
    """This node's role in `job` from the Slurm allocation (None: a one-host job)."""
    allocation = slurm_allocation(environ)
    if allocation is None:
        raise SlurmError("not inside a Slurm job (no SLURM_JOB_ID): the pipeline submits this with sbatch")
    if allocation.nnodes != job.hosts:
        raise SlurmError(f"Slurm job {allocation.job_id} has {allocation.nnodes} node(s), the training job "
                         f"{job.hosts} (orchestration.trainer_hosts): submit it with --nodes={job.hosts}")  # fmt: skip
    if job.hosts == 1:
        return None
    return HostRole(allocation.nnodes, allocation.node_rank, allocation.endpoint).resolved()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m training.launch.slurm_node JOB_FILE", file=sys.stderr)
        return 2
    job = TrainJob.load(Path(args[0]))
    try:
        role = node_role(job, os.environ)
    except SlurmError as error:
        print(f"[train] {error}", file=sys.stderr, flush=True)
        return 2
    where = f"node {role.node_rank} of {role.nnodes}: rendezvous at {role.endpoint}" if role else "one node"
    print(f"[train] Slurm job {os.environ.get('SLURM_JOB_ID')}, {where}; writing into {job.out}", flush=True)
    # scancel (and a requeue) sends SIGTERM: the node's processes end with this one
    with stop_on_signals(lambda line: write_line_to_stderr(f"[train] {line}")):
        try:
            launch(job, on_line=lambda line: print(line, flush=True), role=role)
        except TrainingFailed as failure:
            print(f"[train] failed: {failure}", file=sys.stderr, flush=True)
            return 1
        except Stopped as stop:
            return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
