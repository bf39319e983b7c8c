"""A flow run stopped by Ctrl-C or SIGTERM ends Cancelled, not Crashed.

Prefect marks a run that an interrupt or termination signal ended as Crashed, the state
of a run that died of a fault. A person's stop is a cancellation: this `on_crashed` hook
turns those runs (and only those) into Cancelled, naming the signal and how to resume.
"""

from __future__ import annotations

import logging

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelled, State

log = logging.getLogger("flows.stages.stopped_runs")
# Prefect's messages for a crash by a signal (prefect/states.py)
_STOPPED_BY = {
    "Execution was aborted by an interrupt signal.": "SIGINT (Ctrl-C)",
    "Execution was aborted by a termination signal.": "SIGTERM",
}


def cancel_when_stopped(flow: Flow, flow_run: FlowRun, state: State) -> None:
    """`on_crashed` hook: the run becomes Cancelled when a signal stopped it."""
    signal = _STOPPED_BY.get(state.message or "")
    if signal is None:
        return
    message = f"stopped by {signal}; run the same command again to resume"
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelled(message=message), force=True)
    except Exception as error:  # noqa: BLE001 - the run stays Crashed, which still is not Running
        log.warning("could not mark flow run %s as cancelled: %s", flow_run.name, error)
