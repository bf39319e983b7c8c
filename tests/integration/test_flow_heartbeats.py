"""A real flow run on the session's Prefect server sends its heartbeats from the prompt
heartbeat thread (flows/stages/heartbeats.py), and its end does not wait for the next one."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest
from prefect import flow, flow_engine

from flows.stages import heartbeats

pytestmark = pytest.mark.slow  # the session's Prefect server: left out of `make test-fast`
HEARTBEATS = str(Path(heartbeats.__file__).resolve())


@flow
def _a_short_flow() -> str:
    time.sleep(0.2)
    return "done"


def test_a_flow_run_beats_from_the_prompt_thread_and_ends_with_its_work(prefect_server: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    assert heartbeats.install()
    senders: list[str] = []
    emit = flow_engine.FlowRunEngine._emit_flow_run_heartbeat

    def emit_and_note_who_sent(self, *arguments):  # Prefect's own emission, with the function that called it noted
        caller = inspect.stack()[1]
        senders.append(f"{Path(caller.filename).resolve()}:{caller.function}")
        return emit(self, *arguments)

    monkeypatch.setattr(flow_engine.FlowRunEngine, "_emit_flow_run_heartbeat", emit_and_note_who_sent)
    began = time.monotonic()
    assert _a_short_flow() == "done"
    took = time.monotonic() - began
    assert senders == [f"{HEARTBEATS}:beat"], "one heartbeat, as the run started, from the prompt thread"
    # Prefect's own thread sleeps whole seconds and the run's end joins it: 0.2 s of work took ~1 s or more
    assert took < 0.9, f"the flow call took {took:.2f} s for 0.2 s of work"
