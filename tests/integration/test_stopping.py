"""Ctrl-C and SIGTERM on a real `dlrm run`: every process it started ends within seconds,
its Prefect flow runs end Cancelled (none left Running), the exit code names the signal,
and the same command afterwards resumes from the interrupted run's checkpoint (twice
stopped, one run folder: each stop is tested on the command that resumed the one before).
A command killed outright (SIGKILL) while it holds a trainer slot: the next command gets the
slot once its lease has expired."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm_commands
from ports import free_port
from process_tree import descendants, left_running

from training.job import JobFolder
from training.launch.warm_ranks import ENVIRONMENT_KEY

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.launcher]
# Long enough that a stop after the first checkpoint (step 20) and another after a later one
# land mid-training (172 steps of the tiny config), short enough that the resumed run ends soon after
EPOCHS = 4
# What a stopped command started ends within seconds of it: a forked rank is killed by its
# watcher once its stand-in has gone, a flow run's process once its runner has, and on a busy
# machine (three test processes on two cores) that took longer than a second
STOPPED_WITHIN_S = 10.0


def _command(run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "run", "--config", str(ROOT / "configs" / "tiny.toml"),
        "--set", f'run_dir="{run_dir}"', "--set", f"training.epochs={EPOCHS}", "--set",
        "training.checkpoint_every=20", "--json",
    ]  # fmt: skip


def _environment(home: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)  # the command's own temporary server: the one a stop must not break
    return env


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(meta.parent.name.split("-")[1]) for meta in run_dir.glob("train/checkpoints/*/step-*/meta.json")]


def _start_and_wait_for_a_checkpoint(run_dir: Path, home: Path, log: Path, after_step: int = 0) -> subprocess.Popen:
    """`dlrm run`, once it has saved a checkpoint past `after_step` (it is training then)."""
    process = subprocess.Popen(_command(run_dir), cwd=ROOT, env=_environment(home), stdout=subprocess.DEVNULL,
                               stderr=log.open("w"), start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while max(_checkpoint_steps(run_dir), default=0) <= after_step:
        assert process.poll() is None, f"the run ended before its checkpoint:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    return process


def _flow_run_states(home: Path) -> dict[str, str]:
    """Each flow's newest run's state (the module's commands share one Prefect home)."""
    with sqlite3.connect(home / "prefect.db") as db:
        return {name: state for name, state in db.execute("SELECT flow.name, flow_run.state_type FROM flow_run "
                                                          "JOIN flow ON flow.id = flow_run.flow_id "
                                                          "ORDER BY flow_run.created")}  # fmt: skip


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Prefect home of the module's commands: its database is created once, by the first
    (each command still starts its own server on it, the one a stop must not break)."""
    return tmp_path_factory.mktemp("prefect-home")


def _started_by(process: subprocess.Popen, jobs: list[JobFolder]) -> set[int]:
    """The processes `process` started: those below it, and the ranks of its training `jobs`
    (forked by the session's warm-rank server for torchrun: tests/integration/conftest.py)."""
    return descendants(process.pid) | {pid for job in jobs for pid in job.rank_pids().values()}


def _stop(process: subprocess.Popen, signum: int, times: int = 1, log: Path | None = None,
          jobs: list[JobFolder] | None = None) -> tuple[int, float, set[int]]:  # fmt: skip
    """Signal the command as a terminal would (its process group), `times` times; returns
    its exit code, the seconds it took, and the processes it had started (with the ranks of its
    training `jobs`). A command still running a minute later fails the test with the end of
    its `log`."""
    started = _started_by(process, jobs or [])
    assert started, "the command had started processes (a Prefect server, torchrun, workers)"
    began = time.monotonic()
    for _ in range(times):
        os.killpg(process.pid, signum)
        time.sleep(0.3)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"still running 60 s after {signal.Signals(signum).name}:\n"
                    f"{log.read_text()[-4000:] if log else ''}")  # fmt: skip
    return code, time.monotonic() - began, started


@pytest.fixture(scope="module")
def stopped_twice_then_finished(tmp_path_factory: pytest.TempPathFactory, home: Path, warm_rank_server: Path,
                                prefect_server: str):  # fmt: skip
    """One run folder: `dlrm run` stopped by Ctrl-C twice, the same command stopped by SIGTERM
    (to the process only, as a supervisor stops it) once it has trained on past the first
    stop, then the same command to its end (warm). What each stop and the last run left."""
    tmp_path = tmp_path_factory.mktemp("stopping")
    run_dir = tmp_path / "run"
    training = [JobFolder(run_dir / "train")]  # the pipeline's training job
    stops = {}
    process = _start_and_wait_for_a_checkpoint(run_dir, home, tmp_path / "ctrl-c.log")
    stops["SIGINT"] = (*_stop(process, signal.SIGINT, times=2, jobs=training), (tmp_path / "ctrl-c.log").read_text(),
                       _flow_run_states(home))  # fmt: skip
    first_stop = max(_checkpoint_steps(run_dir))
    process = _start_and_wait_for_a_checkpoint(run_dir, home, tmp_path / "sigterm.log", after_step=first_stop)
    started = _started_by(process, training)
    began = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)
    stops["SIGTERM"] = (process.wait(timeout=60), time.monotonic() - began, started,
                        (tmp_path / "sigterm.log").read_text(), _flow_run_states(home))  # fmt: skip
    second_stop = max(_checkpoint_steps(run_dir))
    # the resume stops nothing: a warm command on warm ranks (tests/warm_commands.py), which
    # resumes through the same launcher, and the session's Prefect server (the run folder, not
    # Prefect, holds what it resumes)
    warm = {**_environment(home), "PREFECT_API_URL": prefect_server, ENVIRONMENT_KEY: str(warm_rank_server)}
    again = subprocess.run([*warm_commands.dlrm(), *_command(run_dir)[3:]], check=False, cwd=ROOT, env=warm,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    return stops, (first_stop, second_stop), again


@pytest.mark.parametrize(("signame", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_ends_everything_the_run_started_and_marks_its_flow_runs(stopped_twice_then_finished, signame: str,
                                                                         code: int) -> None:  # fmt: skip
    stops, _, _ = stopped_twice_then_finished
    exit_code, seconds, started, log, states = stops[signame]
    assert exit_code == code, log[-3000:]
    assert seconds < 30, f"stopping took {seconds:.0f} s"
    assert started, "the command had started processes (a Prefect server, torchrun, workers)"
    left = left_running(started, within_s=STOPPED_WITHIN_S)
    assert not left, f"no process the command started outlives it: {left}"
    assert log.splitlines()[-1] == f"dlrm: stopped by {signame}" and "Traceback" not in log
    assert "RUNNING" not in states.values(), states
    if signame == "SIGINT":
        assert states["pipeline"] == "CANCELLED" and states["train"] == "CANCELLED", states


def test_the_same_command_resumes_from_the_last_stop_and_trains_every_row(stopped_twice_then_finished) -> None:
    _, (first_stop, second_stop), again = stopped_twice_then_finished
    assert 20 <= first_stop < second_stop, "the second run trained on from the first stop's checkpoint"
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == second_stop, "the same command resumes the interrupted run"
    trained_on = 12_000 - summary["calibration_rows"]  # the rest is held out for the calibrator
    assert summary["rows_trained"] == trained_on * EPOCHS, "every training row once an epoch, across both resumes"
    assert "resuming the interrupted run from step-" in again.stderr


def test_serve_with_server_shows_its_deployments_in_the_ui_and_ctrl_c_stops_it_and_its_retrain(
    tmp_path: Path, home: Path
) -> None:
    """The README's dashboard steps: `dlrm serve --with-server`, the UI lists the deployments
    (headless Chromium), a retrain runs; then Ctrl-C ends the retrain, the server and serve."""
    run_dir, log = tmp_path / "run", tmp_path / "stderr.log"
    port = free_port()
    command = [sys.executable, "-m", "flows.cli", "serve", "--config", str(ROOT / "configs" / "tiny.toml"),
               "--set", f'run_dir="{run_dir}"', "--set", "training.epochs=30", "--set", "training.checkpoint_every=20",
               "--with-server", "--port", str(port)]  # fmt: skip
    # the retrain picked up within 2 s, not Prefect's 10
    env = {**_environment(home), "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    with _killed_if_left(process):
        _use_the_dashboard_then_stop(process, port, run_dir, log, home)


@contextlib.contextmanager
def _killed_if_left(process: subprocess.Popen) -> Iterator[None]:
    """A failing test does not leave the command (and what it started) running."""
    try:
        yield
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _use_the_dashboard_then_stop(process: subprocess.Popen, port: int, run_dir: Path, log: Path, home: Path) -> None:
    from playwright.sync_api import sync_playwright

    deadline = time.monotonic() + 240
    while "prefect deployment run" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    ui = f"http://127.0.0.1:{port}"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{ui}/deployments", wait_until="networkidle")
            for name in ("nightly", "retrain", "retune"):
                page.get_by_text(name, exact=True).first.wait_for(timeout=30_000)
        finally:
            browser.close()
    subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "retrain/retrain"], check=True,
                   env={**_environment(home), "PREFECT_API_URL": f"{ui}/api"}, capture_output=True)  # fmt: skip
    while not list(run_dir.glob("train/checkpoints/*/step-*/meta.json")):
        assert process.poll() is None and time.monotonic() < deadline + 240, log.read_text()[-3000:]
        time.sleep(0.2)

    code, seconds, started = _stop(process, signal.SIGINT, log=log, jobs=[JobFolder(run_dir / "train")])
    assert code == 130 and seconds < 30, (code, seconds, log.read_text()[-3000:])
    left = left_running(started, within_s=STOPPED_WITHIN_S)
    assert not left, f"no trainer, flow-run process or server outlives serve: {left}"
    states = _flow_run_states(home)
    assert states["retrain"] == "CANCELLED" and states["train"] == "CANCELLED", states
    assert "RUNNING" not in states.values(), states


def test_serve_without_a_server_says_how_to_get_one(tmp_path: Path) -> None:
    done = subprocess.run([*warm_commands.dlrm(), "serve", "--config", str(ROOT / "configs" / "tiny.toml")],  # no stop: warm
                          check=False, cwd=ROOT, env=_environment(tmp_path / "prefect"), capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--with-server" in done.stderr and "dlrm server" in done.stderr and "PREFECT_API_URL" in done.stderr


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def test_ctrl_c_stops_a_retune_and_marks_its_mlflow_runs_killed(tmp_path: Path) -> None:
    """In a Prefect home of its own: the earlier tests' stopped runs may still count in the
    trainer slots' limit there (their slot leases lived in the temporary servers that ended
    with them), and a retune waits for a free slot."""
    from mlflow.tracking import MlflowClient

    from flows.run.config import load_config

    run_dir, home, log = tmp_path / "run", tmp_path / "prefect", tmp_path / "stderr.log"
    overrides = ["--set", f'run_dir="{run_dir}"', "--set", "training.epochs=30"]
    command = [sys.executable, "-m", "flows.cli", "retune", "--config", str(ROOT / "configs" / "tiny.toml"),
               *overrides, "--trials", "5"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=_environment(home), stdout=subprocess.DEVNULL,
                               stderr=log.open("w"), start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not [trial for trial in run_dir.glob("tuning/*/trial-*") if JobFolder(trial).metrics.is_file()]:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # the trial is training

    trials = [JobFolder(trial) for trial in run_dir.glob("tuning/*/trial-*")]
    code, seconds, started = _stop(process, signal.SIGINT, log=log, jobs=trials)
    assert code == 130 and seconds < 30, (code, seconds, log.read_text()[-3000:])
    left = left_running(started, within_s=STOPPED_WITHIN_S)
    assert not left, f"no trial process or server outlives the retune: {left}"
    assert _flow_run_states(home)["retune"] == "CANCELLED"
    config = load_config(ROOT / "configs" / "tiny.toml", [f'run_dir="{run_dir}"'])
    client = MlflowClient(tracking_uri=config.tracking_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert runs and not [r for r in runs if r.info.status == "RUNNING"], [(r.info.run_name, r.info.status) for r in runs]
    stopped = [r for r in runs if r.data.tags.get("tuning.state") == "stopped"]
    assert len(stopped) == 1 and stopped[0].info.status == "KILLED", "the trial in flight is marked stopped"


def test_dlrm_server_serves_the_ui_until_ctrl_c(tmp_path: Path, home: Path) -> None:
    import httpx

    port, log = free_port(), tmp_path / "server.log"
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "server", "--port", str(port)], cwd=ROOT,
                               env=_environment(home), stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while "Prefect UI:" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    assert f"export PREFECT_API_URL=http://127.0.0.1:{port}/api" in log.read_text()
    assert httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=10).status_code == 200
    assert "<html" in httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text.lower(), "the UI is served"

    code, seconds, started = _stop(process, signal.SIGINT, log=log)
    assert code == 130 and seconds < 30, (code, seconds, log.read_text()[-3000:])
    left = left_running(started, within_s=STOPPED_WITHIN_S)
    assert not left, f"the server ends with the command: {left}"


# A command killed outright (SIGKILL) while it holds a trainer slot. Started with the module
# (autouse) in a thread of its own: the next command waits about the slot's lease (60 s, the
# shortest the Prefect server takes) while the stops below run; the module's last test reads
# what it waited.
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


@dataclass
class KilledHolder:
    home: Path
    url: str = ""
    waiter: subprocess.Popen | None = None
    failure: str = ""


def _kill_a_holder_then_ask_again(scenario: KilledHolder) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(scenario.home)
    tiny = str(ROOT / "configs" / "tiny.toml")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, tiny], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        scenario.url = holder.stdout.readline().strip()
    finally:
        holder.kill()
        holder.wait()
    if not scenario.url.startswith("http://127.0.0.1:"):
        scenario.failure = f"the holder did not take its slot on a temporary server of its own: {scenario.url!r}"
        return
    port = int(scenario.url.rsplit(":", 1)[1].split("/")[0])
    for pid in _servers_on(port):  # the killed command's server, left running: it stops as a lost host would
        os.kill(pid, signal.SIGKILL)
    scenario.waiter = subprocess.Popen([sys.executable, "-c", WAITER, tiny], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def killed_holder(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KilledHolder, threading.Thread]]:  # fmt: skip
    scenario = KilledHolder(tmp_path_factory.mktemp("killed-holder") / "prefect")
    started = threading.Thread(target=_kill_a_holder_then_ask_again, args=(scenario,), daemon=True)
    if any(item.name == test_a_slot_whose_holder_was_killed_is_given_back_by_the_next_commands_server.__name__
           for item in request.session.items):  # fmt: skip
        started.start()  # only when its test runs
    yield scenario, started
    if started.ident is not None:
        started.join(timeout=120)
    if scenario.waiter is not None and scenario.waiter.poll() is None:
        scenario.waiter.kill()
        scenario.waiter.wait()


def test_a_slot_whose_holder_was_killed_is_given_back_by_the_next_commands_server(killed_holder) -> None:
    """A command killed outright while it trains (SIGKILL: no clean-up runs) cannot give its
    slot back, and its temporary server's end would once have left the slot counted in the
    Prefect home for ever. Its lease is kept in the home, so the next command's own
    temporary server revokes it once it expires: that command waits about the lease, not for
    ever (Prefect's default lease, 300 s, would also fail the bound)."""
    scenario, started = killed_holder
    started.join(timeout=120)
    assert not scenario.failure and scenario.waiter is not None, scenario.failure
    out, err = scenario.waiter.communicate(timeout=300)
    assert scenario.waiter.returncode == 0, err[-3000:]
    waited = float(out.split("waited ")[1].split()[0])
    # the lease (60 s from the holder's last renewal), the sweep (15 s) and a retry (≤ 30 s)
    assert 30 < waited < 60 + 15 + 30 + 10, f"the killed holder's slot came back after {waited:.0f} s"
    assert list((scenario.home / "concurrency_leases").glob("*.json")), "the leases are kept in the home"
