"""The pipeline's training stage across several hosts, through Prefect.

Each trainer host serves its part as a deployment, `train-node/node-R`
(`dlrm serve --trainer-node R`, with PREFECT_API_URL naming the shared server). The stage
writes the job into the shared run folder, starts one flow run per host and waits for them
all: every host trains its ranks of the same job (training/launch/host_role.py), node 0 writes the
summary, and the stage reads it from the folder. A host that fails stops the others
(through the run folder, as `dlrm train` does); a stop of the stage cancels every host's run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling

from flows.stages import heartbeats
from flows.stages.stopped_runs import cancel_when_stopped
from training.job import TrainJob
from training.launch.host_role import HostRole
from training.launch.launcher import TrainingFailed, launch

heartbeats.install()  # this module's flow runs end when their work ends

FLOW_NAME = "train-node"
POLL_S = 2.0


def node_deployment(node_rank: int) -> str:
    return f"node-{node_rank}"


@flow(name=FLOW_NAME, on_crashed=[cancel_when_stopped])
def train_node(job_file: str, node_rank: int, rdzv_endpoint: str, join_timeout_s: int = 300) -> None:
    """This host's part of a multi-host training job the pipeline started."""
    job = TrainJob.load(Path(job_file))
    nnodes = job.hosts
    role = HostRole(nnodes, node_rank, rdzv_endpoint, join_timeout_s=join_timeout_s).resolved()
    logger = get_run_logger()
    logger.info("node %d of %d: rendezvous at %s, this host as %s on %s", node_rank, nnodes, rdzv_endpoint,
                role.local_addr, role.socket_ifname)  # fmt: skip
    launch(job, on_line=logger.info, role=role)


def train_on_hosts(job: TrainJob, rdzv_endpoint: str, say: Callable[[str], None], join_timeout_s: int = 300) -> None:
    """Run `job` on its hosts, each serving `train-node/node-R`; return once all are done."""
    nnodes = job.hosts
    job.out.mkdir(parents=True, exist_ok=True)
    job_file = job.folder.hosts_job_file  # in the shared run folder: every host reads this one job
    job.save(job_file)
    with get_client(sync_client=True) as client:
        runs = [_start_node(client, job_file, node, rdzv_endpoint, join_timeout_s) for node in range(nnodes)]
        say(f"[train] started the job on {nnodes} hosts: flow runs {', '.join(str(run) for run in runs)}")
        try:
            _wait_for_nodes(client, runs, join_timeout_s)
        except BaseException:
            for run in runs:  # a failed host, or a stop here: no host keeps training alone
                state = client.read_flow_run(run).state
                if state is not None and not state.is_final():
                    client.set_flow_run_state(run, Cancelling(message="the multi-host job ended"), force=True)
            raise


def _start_node(client: SyncPrefectClient, job_file: Path, node: int, endpoint: str,
                join_timeout_s: int) -> UUID:  # fmt: skip
    name = f"{FLOW_NAME}/{node_deployment(node)}"
    try:
        deployment = client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise TrainingFailed(f"no host serves {name}: run `dlrm serve --trainer-node {node} --config …` on the "
                             "host of that node rank, with PREFECT_API_URL naming this server", node, 1) from None  # fmt: skip
    parameters = {"job_file": str(job_file), "node_rank": node, "rdzv_endpoint": endpoint,
                  "join_timeout_s": join_timeout_s}  # fmt: skip
    return client.create_flow_run_from_deployment(deployment.id, parameters=parameters).id


def _wait_for_nodes(client: SyncPrefectClient, runs: list[UUID], join_timeout_s: int) -> None:
    """Until every host's run completes; a run that fails, or is not picked up in time, fails the job."""
    deadline = time.monotonic() + join_timeout_s
    while True:
        states = [client.read_flow_run(run).state for run in runs]
        for node, state in enumerate(states):
            if state is not None and state.is_final() and not state.is_completed():
                raise TrainingFailed(f"training failed on node {node}: its flow run ended {state.name} "
                                     f"({state.message or 'no message'})", node, 1)  # fmt: skip
        if all(state is not None and state.is_completed() for state in states):
            return
        waiting = [node for node, state in enumerate(states) if state is None or state.is_scheduled() or state.is_pending()]
        if waiting and time.monotonic() > deadline:
            raise TrainingFailed(f"node(s) {waiting} did not start their part within {join_timeout_s} s: is "
                                 "`dlrm serve --trainer-node N` running on each host?", waiting[0], 1)  # fmt: skip
        time.sleep(POLL_S)
