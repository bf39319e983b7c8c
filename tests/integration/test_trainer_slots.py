"""Training jobs take turns through the Prefect concurrency limit, on a real Prefect server."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
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
from flows.stages.local_server import prefect_api
from flows.stages.trainer_slots import trainer_slot
config = load_config(sys.argv[1], ["orchestration.trainer_slot_lease_s=60"])
with prefect_api() as url, trainer_slot(config, logging.getLogger("holder")):
    print(url, flush=True)
    time.sleep(600)
"""

WAITER = """
import logging, sys, time
from flows.run.config import load_config
from flows.stages.local_server import prefect_api
from flows.stages.trainer_slots import trainer_slot
config = load_config(sys.argv[1], ["orchestration.trainer_slot_lease_s=60"])
with prefect_api():
    asked = time.monotonic()
    with trainer_slot(config, logging.getLogger("waiter")):
        print(f"waited {time.monotonic() - asked:.1f}", flush=True)
"""


def _servers_on(port: int) -> list[int]:
    """The processes of the Prefect server listening on `port` (by their command line)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in words and str(port).encode() in words:
            found.append(int(cmdline.parent.name))
    return found


def test_a_slot_whose_holder_was_killed_is_given_back_by_the_next_commands_server(tmp_path: Path) -> None:
    """A command killed outright while it trains (SIGKILL: no clean-up runs) cannot give its
    slot back, and its temporary server's end would once have left the slot counted in the
    Prefect home for ever. Its lease is kept in the home, so the next command's own
    temporary server revokes it once it expires: that command waits about the lease, not for
    ever (Prefect's default lease, 300 s, would also fail the bound)."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    tiny = str(ROOT / "configs" / "tiny.toml")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, tiny], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        url = holder.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), "the holder took its slot on a temporary server of its own"
    finally:
        holder.kill()
        holder.wait()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for pid in _servers_on(port):  # the killed command's server, left running: it stops as a lost host would
        os.kill(pid, signal.SIGKILL)
    done = subprocess.run([sys.executable, "-c", WAITER, tiny], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    waited = float(done.stdout.split("waited ")[1].split()[0])
    # the lease (60 s from the holder's last renewal), the sweep (15 s) and a retry (≤ 30 s)
    assert 30 < waited < 60 + 15 + 30 + 10, f"the killed holder's slot came back after {waited:.0f} s"
    assert list((tmp_path / "prefect" / "concurrency_leases").glob("*.json")), "the leases are kept in the home"
