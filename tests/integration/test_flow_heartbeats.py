"""A real flow run on the session's Prefect server sends its heartbeats from the prompt
heartbeat thread (flows/stages/heartbeats.py)."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path

import pytest
from prefect import flow, flow_engine

from flows.stages import heartbeats

pytestmark = pytest.mark.slow  # the session's Prefect server: left out of `make test-fast`
HEARTBEATS = str(Path(heartbeats.__file__).resolve())
BEAT = threading.Event()


@flow
def _a_flow_that_waits_for_its_heartbeat() -> bool:
    return BEAT.wait(30)


def test_a_flow_run_beats_from_the_prompt_thread(prefect_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert heartbeats.install()
    senders: list[str] = []
    emit = flow_engine.FlowRunEngine._emit_flow_run_heartbeat

    def emit_and_note_who_sent(self, *arguments):  # Prefect's own emission, with the function that called it noted
        caller = inspect.stack()[1]
        senders.append(f"{Path(caller.filename).resolve()}:{caller.function}")
        try:
            return emit(self, *arguments)
        finally:
            BEAT.set()

    monkeypatch.setattr(flow_engine.FlowRunEngine, "_emit_flow_run_heartbeat", emit_and_note_who_sent)
    assert _a_flow_that_waits_for_its_heartbeat(), "a heartbeat while the run ran"
    # (how long its end waits is tests/unit/flows/test_heartbeats.py's, on a stand-in engine,
    # and bench/flow_run_end.py's: a flow call's time on a busy machine is no measure of it)
    assert senders == [f"{HEARTBEATS}:beat"], "one heartbeat, as the run started, from the prompt thread"
