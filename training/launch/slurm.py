"""A job's hosts as a Slurm allocation gives them: `srun dlrm train --config C` on every node
of an allocation needs no `--nnodes`, `--node-rank` or `--rdzv-endpoint`.

Slurm tells each task its allocation in the environment: how many nodes (`SLURM_NNODES`;
inside an `srun` step, the step's `SLURM_STEP_NUM_NODES`), which one this is (`SLURM_NODEID`,
0-based, in the order of the node list) and the node list (`SLURM_JOB_NODELIST`, or the
step's `SLURM_STEP_NODELIST`: a host-list expression such as `gpu[01-04,07]`). Node 0 of the list
hosts the rendezvous, on a port taken from the job id, so that two jobs sharing a node do not
meet at the same port. One training command runs per node (torchrun starts the node's
processes), so a step with several tasks on a node, or the batch script itself starting a
job of several nodes without `srun`, is refused with the line that fixes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# Rendezvous ports, one per job id: 29400 (torchrun's default) + job id mod 1,000
FIRST_PORT, PORTS = 29_400, 1_000


class SlurmError(ValueError):
    """An allocation that cannot run the job as asked; says what to do."""


@dataclass(frozen=True)
class SlurmAllocation:
    """This task's place in a Slurm job."""

    job_id: str
    nnodes: int
    node_rank: int
    first_host: str

    @property
    def endpoint(self) -> str:
        """Node 0's host and this job's rendezvous port."""
        digits = int(re.sub(r"\D", "", self.job_id) or 0)
        return f"{self.first_host}:{FIRST_PORT + digits % PORTS}"


def slurm_allocation(environ: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation this process runs in (None outside Slurm)."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    # inside an `srun` step, the step's nodes (all of the job's unless it asked for fewer)
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST", ""))  # fmt: skip
    try:
        nnodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
                     or environ.get("SLURM_JOB_NUM_NODES") or 1)  # fmt: skip
        node_rank = int(environ.get("SLURM_NODEID", "0"))
    except ValueError as error:
        raise SlurmError(f"Slurm job {job_id}: unreadable node count or node id ({error})") from None
    if not nodelist:
        raise SlurmError(f"Slurm job {job_id}: SLURM_JOB_NODELIST is not set; run inside `srun` or `sbatch`")
    allocation = SlurmAllocation(job_id, nnodes, node_rank, first_host(nodelist))
    if nnodes > 1 and "SLURM_STEP_ID" not in environ:
        raise SlurmError(f"Slurm job {job_id} has {nnodes} nodes and this is its batch script: start the training on "
                         "each of them with `srun --ntasks-per-node=1 dlrm train …`")  # fmt: skip
    tasks_here = environ.get("SLURM_STEP_TASKS_PER_NODE", "1")  # the step's, not the job's request
    if _first_count(tasks_here) > 1:
        raise SlurmError(f"Slurm job {job_id} runs {tasks_here} tasks a node: run one `dlrm train` a node "
                         "(`srun --ntasks-per-node=1`); it starts training.nproc processes there itself")  # fmt: skip
    return allocation


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host-list expression: `gpu[07-09,12]` → `gpu07`,
    `rack[2-3]-n[01-04],login` → `rack2-n01`."""
    first = _split_top_level(nodelist.strip())[0]
    host = re.sub(r"\[([^\]]*)\]", lambda group: group[1].split(",")[0].split("-")[0], first)
    if not host or any(c in host for c in "[],"):
        raise SlurmError(f"SLURM_JOB_NODELIST {nodelist!r}: not a host list")
    return host


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _first_count(tasks_per_node: str) -> int:
    """`SLURM_TASKS_PER_NODE` is written as `2(x3),1`: the first node's count."""
    match = re.match(r"\s*(\d+)", tasks_per_node)
    return int(match[1]) if match else 1
