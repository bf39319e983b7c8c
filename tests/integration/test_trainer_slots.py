"""Training jobs take turns through the Prefect concurrency limit, on a real Prefect server."""

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


HOLDER = """
import logging, sys, time
from flows.run.config import load_config
from flows.stages.trainer_slots import trainer_slot
config = load_config(sys.argv[1], ["orchestration.trainer_slot_lease_s=5"])
with trainer_slot(config, logging.getLogger("holder")):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_slot_whose_holder_was_killed_is_given_back(prefect_server: str, tmp_path: Path) -> None:
    """A job killed outright (SIGKILL: no clean-up runs) cannot give its slot back; its lease
    expires and the server revokes it, so the next training starts instead of waiting for ever."""
    import os
    import subprocess
    import sys

    tiny = str(ROOT / "configs" / "tiny.toml")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, tiny], cwd=ROOT, env=os.environ.copy(),
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait()
    config = load_config(ROOT / "configs" / "tiny.toml", ["orchestration.trainer_slot_lease_s=5"])
    started = time.monotonic()
    with trainer_slot(config, logging.getLogger("test")):
        waited = time.monotonic() - started
    assert waited < 120, f"the killed holder's slot came back after {waited:.0f} s"
