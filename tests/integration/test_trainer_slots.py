"""Training jobs take turns through the Prefect concurrency limit, on a real Prefect server.
(A slot whose holder was killed outright: tests/integration/test_stopping.py.)"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from flows.run.config import load_config
from flows.stages.trainer_slots import trainer_slot, waits_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _hold(config, log: logging.Logger, spans: list[tuple[float, float]], seconds: float) -> None:
    with trainer_slot(config, log):
        began = time.monotonic()
        time.sleep(seconds)
        spans.append((began, time.monotonic()))


@pytest.mark.parametrize("slots", [1, 0])
def test_a_second_training_job_waits_for_the_first_unless_slots_are_off(prefect_server: str, slots: int) -> None:
    config = load_config(ROOT / "configs" / "tiny.toml", [f"orchestration.trainer_slots={slots}"])
    spans: list[tuple[float, float]] = []
    jobs = [threading.Thread(target=_hold, args=(config, logging.getLogger("test"), spans, 2.0)) for _ in range(2)]
    for job in jobs:
        job.start()
        time.sleep(0.3)
    for job in jobs:
        job.join(timeout=60)
    (_, first_end), (second_start, _) = sorted(spans)
    if slots:
        assert second_start >= first_end - 0.05, "the second job trained only after the first"
        assert "after this run's training" in waits_for(config)
    else:
        assert second_start < first_end, "no limit: both at once"
        assert "at once" in waits_for(config)
