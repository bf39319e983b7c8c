"""Flow runs that end when their work ends.

Prefect keeps a flow run's heartbeat in a thread that sleeps in steps of one second and
joins it when the run ends, so every flow run's end waits for that thread's current second
to pass: up to a second a flow run, about 2 s of each `dlrm run` (its five flows' runs) and
of every night (bench/flow_run_end.py). Here the thread waits on its stop event instead, so
it ends the moment the run does. The heartbeats are Prefect's own (its event template,
emitter and interval); only the wait between two of them changes. Each module that declares
flows installs it when it is imported; a Prefect whose engine lacks what it replaces, reads
or calls is left as it is.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow_engine

# what `prompt_heartbeats` reads and calls of Prefect's engine: a Prefect without them keeps its own
_ENGINE_PARTS = ("heartbeat_seconds", "_build_heartbeat_event_template", "_emit_flow_run_heartbeat")
PREFECTS_OWN = getattr(flow_engine, "_send_heartbeats", None)  # what `install` replaces (bench/flow_run_end.py times both)


@contextmanager
def prompt_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Prefect's flow-run heartbeats (`flow_engine._send_heartbeats`), the wait between two
    of them on an event that the run's end sets."""
    seconds = engine.heartbeat_seconds
    if seconds is None:
        yield
        return
    seconds = max(seconds, flow_engine.MINIMUM_HEARTBEAT_INTERVAL)
    resource, related = engine._build_heartbeat_event_template()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            run = engine.flow_run
            if run is not None and run.state is not None and run.state.is_final():
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:  # a missed heartbeat must not fail the run; Prefect logs it the same way
                engine.logger.debug("Failed to emit heartbeat", exc_info=True)
            stop.wait(seconds)

    # the caller's context, so the thread reads the same Prefect settings (its API URL)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        if join_on_exit:
            thread.join(timeout=2)


def install() -> bool:
    """Replace Prefect's heartbeat context with `prompt_heartbeats`; whether it is in place."""
    engine = getattr(flow_engine, "BaseFlowRunEngine", None)
    if (PREFECTS_OWN is None or not hasattr(flow_engine, "MINIMUM_HEARTBEAT_INTERVAL")
            or not all(hasattr(engine, part) for part in _ENGINE_PARTS)):  # fmt: skip
        return False
    flow_engine._send_heartbeats = prompt_heartbeats
    return True
