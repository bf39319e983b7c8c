"""Child process groups end with their parent, and a stop reaches them once, however many
signals come."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _parent(body: str) -> subprocess.Popen:
    script = "import sys, time\nfrom training.launch.processes import *\n" + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_group_dies_with_a_parent_killed_outright() -> None:
    parent = _parent("""
        child = start_group(["sleep", "60"])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    child = int(parent.stdout.readline())
    assert not _gone(child, 0.5), "the child runs while its parent does"
    parent.kill()  # SIGKILL: no clean-up code runs in the parent
    parent.wait()
    assert _gone(child, 5.0), "the child ended with its parent"


def test_the_first_signal_stops_the_groups_and_a_second_only_says_so() -> None:
    parent = _parent("""
        try:
            with stop_on_signals(lambda line: print(line, file=sys.stderr, flush=True)):
                child = start_group(["sleep", "60"])
                print(child.pid, flush=True)
                time.sleep(60)
        except Stopped as stopped:
            time.sleep(0.5)  # a second signal arrives during the clean-up
            print("exit", stopped.exit_code, file=sys.stderr, flush=True)
            sys.exit(stopped.exit_code)
    """)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGINT)
    time.sleep(0.2)
    parent.send_signal(signal.SIGINT)
    _, stderr = parent.communicate(timeout=30)
    assert parent.returncode == 130, stderr
    lines = stderr.splitlines()
    assert lines[0].startswith("SIGINT: stopping") and lines[1].startswith("SIGINT: already stopping"), stderr
    assert lines[-1] == "exit 130"
    assert _gone(child, 5.0), "the stop ended the child's group"


def test_sigterm_exits_143_and_nothing_starts_after_a_stop() -> None:
    parent = _parent("""
        try:
            with stop_on_signals(lambda line: None):
                print("ready", flush=True)
                time.sleep(60)
        except Stopped as stopped:
            try:
                start_group(["sleep", "60"])
            except Stopped:
                sys.exit(stopped.exit_code)
            sys.exit(1)
    """)
    assert parent.stdout.readline().strip() == "ready"
    os.kill(parent.pid, signal.SIGTERM)
    parent.wait(timeout=30)
    assert parent.returncode == 143
