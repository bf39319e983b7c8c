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
        said = []
        def say(line):
            said.append(line)
            print(line, file=sys.stderr, flush=True)
        try:
            with stop_on_signals(say):
                child = start_group(["sleep", "60"])
                print(child.pid, flush=True)
                time.sleep(60)
        except Stopped as stopped:
            deadline = time.monotonic() + 20
            while len(said) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # the clean-up, during which a second signal arrives
            print("exit", stopped.exit_code, file=sys.stderr, flush=True)
            sys.exit(stopped.exit_code)
    """)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGINT)
    # the second once the first was handled: two signals before the handler runs are one
    # (Python runs a signal's handler once however often it came meanwhile)
    first = parent.stderr.readline()
    parent.send_signal(signal.SIGINT)
    _, stderr = parent.communicate(timeout=30)
    stderr = first + stderr
    assert parent.returncode == 130, stderr
    lines = stderr.splitlines()
    assert lines[0].startswith("SIGINT: stopping") and lines[1].startswith("SIGINT: already stopping"), stderr
    assert lines[-1] == "exit 130"
    assert _gone(child, 5.0), "the stop ended the child's group"


def test_a_signal_that_interrupts_the_registry_of_groups_still_stops() -> None:
    """The handler runs on the main thread wherever the signal found it, here inside the
    groups' registry (its lock held): it must neither wait for that lock (the stop would
    never come) nor print through Python's buffers, which the code it interrupted may hold."""
    parent = _parent("""
        import os, signal
        import training.launch.processes as processes
        try:
            with stop_on_signals(write_line_to_stderr):
                child = start_group(["sleep", "60"])
                print(child.pid, flush=True)
                with processes._lock:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(30)
        except Stopped as stopped:
            sys.exit(stopped.exit_code)
    """)
    child = int(parent.stdout.readline())
    _, stderr = parent.communicate(timeout=20)
    assert parent.returncode == 130, stderr
    assert stderr.splitlines()[0].startswith("SIGINT: stopping"), stderr
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child sessions are read from /proc")
def test_a_stop_ends_sessions_a_library_started_at_once_and_kills_one_that_ignores_it() -> None:
    """Prefect's runner starts each served flow run in a session of its own and would end them
    one by one, 30 s each: the stop signals every child session together, kills what is still
    there after the grace, and leaves the services the clean-up needs (started with
    end_on_stop=False) to their owner."""
    parent = _parent("""
        import subprocess, training.launch.processes as processes
        processes.KILL_AFTER_S = 2.0
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
        try:
            with stop_on_signals(lambda line: None):
                polite = subprocess.Popen(["sleep", "60"], start_new_session=True)
                deaf = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE)
                deaf.stdout.readline()  # its handler is set
                service = start_group(["sleep", "60"], end_on_stop=False)
                print(polite.pid, deaf.pid, service.pid, flush=True)
                time.sleep(60)
        except Stopped:
            time.sleep(4.0)  # the owner's clean-up; the service still answers meanwhile
            print("service", "alive" if service.poll() is None else "gone", flush=True)
            for process in (polite, deaf):
                process.wait(timeout=5)
            stop_group(service)
            sys.exit(130)
    """)
    polite, deaf, service = (int(pid) for pid in parent.stdout.readline().split())
    parent.send_signal(signal.SIGINT)
    assert _gone(polite, 1.0), "the SIGTERM reached the session at once"
    assert not _gone(deaf, 1.0), "a process that ignores SIGTERM is still there within the grace"
    assert _gone(deaf, 4.0), "and killed after it"
    stdout, stderr = parent.communicate(timeout=30)
    assert stdout.strip() == "service alive" and parent.returncode == 130, (stdout, stderr)
    assert _gone(service, 1.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_launcher_that_ignores_sigterm_and_its_workers_die_with_a_parent_killed_outright() -> None:
    """torchrun's own SIGTERM shutdown was seen to hang once its parent had gone: started with
    death_signal=SIGKILL it cannot, and its workers (die_with_parent) end with it."""
    launcher = textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker = subprocess.Popen([sys.executable, "-c", "from training.launch.processes import die_with_parent; "
                                   "import time; die_with_parent(); print(1, flush=True); time.sleep(60)"],
                                  stdout=subprocess.PIPE)
        worker.stdout.readline()
        print(worker.pid, flush=True)
        time.sleep(60)
    """)
    parent = _parent(f"""
        import signal
        launcher = start_group([sys.executable, "-c", {launcher!r}], death_signal=signal.SIGKILL, stdout=subprocess.PIPE)
        worker = int(launcher.stdout.readline())
        print(launcher.pid, worker, flush=True)
        time.sleep(60)
    """.replace("import signal", "import signal, subprocess"))
    launcher_pid, worker = (int(pid) for pid in parent.stdout.readline().split())
    assert not _gone(launcher_pid, 0.3) and not _gone(worker, 0.3)
    parent.kill()
    parent.wait()
    assert _gone(launcher_pid, 5.0), "the launcher ended with its parent, SIGTERM ignored or not"
    assert _gone(worker, 5.0), "and its worker with it"


def test_a_stop_in_a_held_block_ends_the_groups_at_once_and_raises_when_the_block_ends() -> None:
    """A write that must not be cut in two (`stops_held`): the signal's line and the end of
    the started processes come at once; the block runs to its end; then the stop is raised."""
    parent = _parent("""
        try:
            with stop_on_signals(lambda line: print(line, file=sys.stderr, flush=True)):
                child = start_group(["sleep", "60"])
                with stops_held():
                    print(child.pid, flush=True)
                    time.sleep(1.5)  # the signal arrives here
                    print("block ended", file=sys.stderr, flush=True)
                print("after the block", file=sys.stderr, flush=True)
        except Stopped as stopped:
            print("exit", stopped.exit_code, file=sys.stderr, flush=True)
            sys.exit(stopped.exit_code)
    """)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGINT)
    assert _gone(child, 1.0), "the started processes end at once, not when the block ends"
    _, stderr = parent.communicate(timeout=30)
    assert parent.returncode == 130, stderr
    lines = stderr.splitlines()
    assert lines[0].startswith("SIGINT: stopping") and lines[1:] == ["block ended", "exit 130"], stderr
