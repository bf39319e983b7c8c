"""`dlrm serve`: the deployments a scheduled, dashboard-driven installation runs.

- `pipeline/nightly`: on `orchestration.nightly_cron`, a recurring run as of the newest
  complete day (flows/run/nights.py): the champion continues on the days it has not seen;
- `retrain/retrain`: the pipeline on demand, with typed parameters (batch size, days), from
  the Prefect UI's Run button or the API;
- `retune/retune`: a study for the config's tuning key (also what `scale_and_schedule`
  creates runs of);
- `characterize/characterize`: `dlrm characterize` from the dashboard (the batch-size curve
  of this hardware, where it saturates).

Served from this process (`prefect.serve`): flow runs execute here, with the project's
environment; `prefect.yaml` offers the same deployments for work pools.
"""

from __future__ import annotations

import logging
import os

from prefect import serve
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron
from prefect.states import Cancelled

from flows.deployments.characterize import characterize_flow
from flows.deployments.pipeline import pipeline, retrain
from flows.run.config import PipelineConfig, load_config
from flows.run.sources import NEWEST
from flows.stages.train_nodes import POLL_S as TRAINER_NODE_POLL_S
from flows.stages.train_nodes import node_deployment, train_node
from flows.tuning.retune import retune
from training.launch.processes import stop_requested

log = logging.getLogger("flows.deployments.serve")


def build_deployments(config_path: str, overrides: list[str] | None = None,
                      config: PipelineConfig | None = None) -> list[RunnerDeployment]:  # fmt: skip
    """The deployments of a config (`config`: the file's, with the overrides, if loaded)."""
    config = config or load_config(config_path, overrides or [])  # a bad config fails here, not at 2 am
    parameters = {"config_path": config_path, "overrides": list(overrides or [])}
    tags = [f"config:{config.name}"]
    return [
        pipeline.to_deployment(
            name="nightly", schedule=Cron(config.orchestration.nightly_cron, timezone=config.orchestration.timezone),
            parameters={**parameters, "as_of": NEWEST}, tags=tags,
            description="Each night: continue the champion on the new days, judged on the newest complete day",
        ),
        retrain.to_deployment(
            name="retrain", parameters=parameters, tags=tags,
            description="Retrain now: ingest, preprocess, train, evaluate, promote (set batch_size or days)",
        ),
        retune.to_deployment(
            name="retune", parameters=parameters, tags=tags,
            description="Retune the hyperparameters of the config's tuning key",
        ),
        characterize_flow.to_deployment(
            name="characterize", parameters=parameters, tags=tags,
            description="Measure this hardware with the config's model: throughput, step time and memory per "
                        "batch size, and the batch where throughput saturates",
        ),
    ]  # fmt: skip


def trainer_node_deployment(node_rank: int) -> RunnerDeployment:
    """This host's part of the pipeline's multi-host training (flows/stages/train_nodes.py)."""
    return train_node.to_deployment(name=node_deployment(node_rank), tags=[f"node:{node_rank}"],
                                    description=f"Node {node_rank}'s part of a multi-host training job")  # fmt: skip


def serve_deployments(config: PipelineConfig, config_path: str, overrides: list[str] | None = None,
                      limit: int | None = None, trainer_node: int | None = None) -> None:  # fmt: skip
    """Register the deployments of `config` (read from `config_path` with `overrides`) and
    run their flow runs until stopped (Ctrl-C, SIGTERM). `trainer_node`: serve only that
    node's part of multi-host training jobs."""
    polling: dict[str, float] = {}
    if trainer_node is None:
        deployments = build_deployments(config_path, overrides, config)
    else:
        deployments = [trainer_node_deployment(trainer_node)]
        if "PREFECT_RUNNER_POLL_FREQUENCY" not in os.environ:
            # a job's every host waits for the last to pick its run up: ask as often as the
            # stage that started them looks at their states, not every 10 s (Prefect's default)
            polling["query_seconds"] = TRAINER_NODE_POLL_S
    quiet_stop = _QuietAfterStop()
    logging.getLogger("asyncio").addFilter(quiet_stop)
    try:
        serve(*deployments, limit=limit, **polling)
    finally:
        logging.getLogger("asyncio").removeFilter(quiet_stop)
        try:
            cancel_runs_left_running(deployments)
        except Exception as error:  # noqa: BLE001 - never hide why serving ended behind a clean-up error
            log.warning("could not mark the runs left running as cancelled: %s", error)


class _QuietAfterStop(logging.Filter):
    """Once a stop is under way, asyncio's reports of the runner's connections cut by it
    (a traceback per connection) say nothing a person needs: the stop's own lines do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return stop_requested() is None


def cancel_runs_left_running(deployments: list[RunnerDeployment]) -> int:
    """Mark Cancelled the runs of these deployments (and their subflow runs) still Running or
    Pending: the runner ends their processes when it stops, and a run it ended must not
    stay "Running" in the UI. Returns how many were marked."""
    active = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
    marked = 0
    with get_client(sync_client=True) as client:
        ids = [client.read_deployment_by_name(f"{d.flow_name}/{d.name}").id for d in deployments]
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=ids), state=active))  # fmt: skip
        while runs:
            for run in runs:
                client.set_flow_run_state(run.id, Cancelled(message="the serving process was stopped"), force=True)
                marked += 1
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id for run in runs]), state=active))  # fmt: skip
    return marked
