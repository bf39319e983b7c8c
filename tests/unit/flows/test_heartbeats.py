"""A flow run's heartbeat thread (flows/stages/heartbeats.py): Prefect's heartbeats, ended
the moment the run ends."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from prefect import flow_engine

from flows.stages import heartbeats


def test_importing_a_module_that_declares_flows_installs_the_prompt_heartbeats() -> None:
    import flows.deployments.characterize
    import flows.deployments.pipeline
    import flows.tuning.retune  # noqa: F401  (each installs it; the three cover every flow)

    assert heartbeats.PREFECTS_OWN is not None, "this Prefect's engine has the function replaced"
    assert flow_engine._send_heartbeats is heartbeats.prompt_heartbeats
    assert heartbeats.install(), "installing again is harmless"


def _engine_mocked(seconds: int | None) -> tuple[SimpleNamespace, list[float], threading.Event]:
    """A stand-in for Prefect's flow run engine: what the heartbeat context reads and calls."""
    beats: list[float] = []
    first = threading.Event()

    def emit(resource: object, related: object) -> None:
        beats.append(time.monotonic())
        first.set()

    engine = SimpleNamespace(heartbeat_seconds=seconds, flow_run=None, logger=SimpleNamespace(debug=lambda *a, **k: None),
                             _build_heartbeat_event_template=lambda: ({}, []), _emit_flow_run_heartbeat=emit)  # fmt: skip
    return engine, beats, first


def test_the_run_beats_at_once_and_its_end_does_not_wait_for_the_next_beat_mocked_engine() -> None:
    engine, beats, first = _engine_mocked(seconds=30)
    threads = set(threading.enumerate())
    with heartbeats.prompt_heartbeats(engine):
        assert first.wait(5), "a heartbeat as the run starts"
        time.sleep(0.05)  # the thread now waits for the next beat, 30 s away
        ended = time.monotonic()
    took = time.monotonic() - ended
    assert len(beats) == 1
    assert took < 0.5, f"the run's end waited {took:.2f} s for its heartbeat thread (Prefect's own waits up to 1 s)"
    assert set(threading.enumerate()) <= threads, "the heartbeat thread has ended"


def test_no_heartbeat_interval_means_no_thread_mocked_engine() -> None:
    engine, beats, _ = _engine_mocked(seconds=None)
    threads = threading.active_count()
    with heartbeats.prompt_heartbeats(engine):
        assert threading.active_count() == threads
    assert beats == []
