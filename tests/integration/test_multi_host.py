"""`dlrm train` across two hosts, simulated as two Linux network namespaces joined by a veth
pair (10.201.0.1 and 10.201.0.2), sharing one run folder: the job trains as one host with
all the processes would, and a host that fails fails the job, which the same commands resume.
The `dlrm` commands are warm (tests/warm_commands.py: forked into the host's namespaces), but
for the one the Ctrl-C test stops; the training they launch across hosts is torchrun's, as
deployed, and each rank it starts is forked into its host by the warm-rank server
(training/launch/warm_ranks.py), not a new interpreter that imports the trainer again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import warm_commands
from beside import start
from process_tree import all_end

from flows.stages.prefect_database import copy_template_to
from training.job import CALIBRATION_PART, JobFolder
from training.launch.launcher import RANK_MODULE
from training.loop.progress import read_records

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
DLRM = str(Path(sys.executable).parent / "dlrm")
HOSTS = {"dlrm-test-h0": "10.201.7.1", "dlrm-test-h1": "10.201.7.2"}
ENDPOINT = "10.201.7.1:29631"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[list[str]]:
    """Two network namespaces, each with one end of a veth pair; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("simulating two hosts needs root and iproute2 (`ip netns`)")
    names = list(HOSTS)
    _remove(names)
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", "dlrmt-h0", "type", "veth", "peer", "name", "dlrmt-h1")
        for index, (name, address) in enumerate(HOSTS.items()):
            _ip("link", "set", f"dlrmt-h{index}", "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"dlrmt-h{index}")
            _ip("-n", name, "link", "set", f"dlrmt-h{index}", "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        _remove(names)
        pytest.skip(f"this machine cannot create network namespaces: {error.stderr.strip()}")
    yield names
    _remove(names)


def _remove(names: list[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def pipeline_run(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """`dlrm run` of the tiny config on one host (2 processes): its run folder, holding the
    warehouse and features every host reads, and its summary."""
    run_dir = tmp_path_factory.mktemp("shared-run")
    return run_dir, start(["run", "--config", TINY], [f'run_dir="{run_dir}"'], run_dir, prefect_server).report(600)


@pytest.fixture(scope="module")
def prepared_run(pipeline_run: tuple[Path, dict]) -> Path:
    return pipeline_run[0]


def _train(run_dir: Path, out: str, nproc: int, *extra: str, host: str | None = None, warm: bool = True) -> subprocess.Popen:
    """`dlrm train`: a warm command (tests/warm_commands.py; on `host`, it runs in that host's
    namespaces), or with `warm=False` the console script in a new interpreter."""
    dlrm = warm_commands.dlrm() if warm else [DLRM]
    command = [*dlrm, "train", "--config", TINY, "--set", f'run_dir="{run_dir}"',
               "--set", f"training.nproc={nproc}", "--set", "training.checkpoint_every=10",
               "--out", str(run_dir / out), "--json", *extra]  # fmt: skip
    if host is not None:
        command = ["ip", "netns", "exec", host, *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _on_two_hosts(run_dir: Path, out: str, nproc: int, names: list[str]) -> list[tuple[int, str, str]]:
    """Both hosts' commands at once; each one's (exit code, stdout, stderr)."""
    hosts = [
        _train(run_dir, out, nproc, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", ENDPOINT, host=name)
        for rank, name in enumerate(names)
    ]
    results = []
    for process in hosts:
        stdout, stderr = process.communicate(timeout=300)
        results.append((process.returncode, stdout, stderr))
    return results


def _report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _alone(run_dir: Path, out: str, nproc: int) -> dict:
    process = _train(run_dir, out, nproc)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    return _report(stdout)


def test_two_hosts_of_two_processes_train_as_one_host_with_all_four(two_hosts: list[str], prepared_run: Path) -> None:
    one_host = _alone(prepared_run, "one-host-4", 4)
    _assert_trains_as_one_host(prepared_run, "two-hosts-2", 2, two_hosts, one_host)


def _assert_trains_as_one_host(run_dir: Path, out: str, nproc: int, names: list[str], one_host: dict) -> dict:
    """`dlrm train` of `nproc` processes on each of the two hosts reports what `one_host` did;
    returns node 0's report."""
    (leader, *_), (follower, *_) = results = _on_two_hosts(run_dir, out, nproc, names)
    assert leader == follower == 0, [stderr[-3000:] for *_, stderr in results]
    report, other = _report(results[0][1]), _report(results[1][1])
    assert other["node_rank"] == 1 and "eval_ne" not in other, "node 0 reports the job"
    assert report["world_size"] == one_host["world_size"] == 2 * nproc
    assert report["global_batch_size"] == one_host["global_batch_size"] == 256, "the batch is global, not per host"
    assert report["steps"] == one_host["steps"] and report["rows_trained"] == one_host["rows_trained"]
    assert report["rows_trained"] + report["calibration_rows"] == 12_000, "less the calibrator's rows, as the pipeline"
    assert report["calibration_rows"] == one_host["calibration_rows"] > 0
    for key in ("eval_ne", "eval_ne_uncalibrated", "eval_calibration"):
        assert abs(report[key] - one_host[key]) <= 1e-6, (key, report[key], one_host[key])
    assert report["calibrator"] == one_host["calibrator"]
    folder = JobFolder(run_dir / out)
    assert folder.logs(0).is_dir() and folder.logs(1).is_dir(), "each host keeps its own logs in the shared folder"
    assert {p.name for p in folder.logs().iterdir()} == {folder.logs(0).name, folder.logs(1).name}
    return report


def _kill_rank_after(folder: JobFolder, rank: int, step: int) -> threading.Thread:
    """SIGKILL rank `rank`'s process (by the pid it wrote into the shared folder) once the job has logged `step`."""

    def watch() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            steps = [record.step for record in read_records(folder.metrics)]
            pid = folder.read_pid(rank)
            if steps and max(steps) >= step and pid is not None:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_dlrm_train_on_two_hosts_fails_together_when_a_worker_dies_then_resumes_to_what_dlrm_run_trained(
    two_hosts: list[str], pipeline_run: tuple[Path, dict]
) -> None:
    """The same job, two ways in: `dlrm run` (one host, 2 processes) and `dlrm train` on two
    hosts of 1 process each, on the features that run prepared. Node 1's process killed
    mid-training fails the job on both hosts (not a lone retry); the same commands again
    resume it from its checkpoint, and it ends as `dlrm run`'s did: the same global batch,
    rows and steps, the same calibrator, the same NE of the served and of the model's own
    probabilities; node 0 reports the job and each host keeps its logs in the shared folder.
    (Two hosts that train without a stop: the test above, two processes each.)"""
    run_dir, one_host = pipeline_run
    watcher = _kill_rank_after(JobFolder(run_dir / "two-hosts-1"), rank=1, step=25)  # node 1's one process
    results = _on_two_hosts(run_dir, "two-hosts-1", 1, two_hosts)
    watcher.join(timeout=10)
    (leader, _, leader_err), (follower, _, follower_err) = results
    assert leader != 0 and follower != 0, "a failed host fails the whole job, not a lone retry"
    assert "rank 1 was killed by SIGKILL" in follower_err and "node 1 of 2" in follower_err
    assert "node 0 of 2" in leader_err and "run the same command on every host" in leader_err

    resumed = _assert_trains_as_one_host(run_dir, "two-hosts-1", 1, two_hosts, one_host)
    assert resumed["resumed_from_step"] >= 20


def test_ctrl_c_on_one_host_stops_every_host(two_hosts: list[str], prepared_run: Path) -> None:
    out = prepared_run / "interrupted"
    hosts = [
        _train(prepared_run, "interrupted", 1, "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", ENDPOINT,
               host=name, warm=rank == 0)  # host 1's command stops on its own, as from a user's terminal
        for rank, name in enumerate(two_hosts)
    ]
    deadline = time.time() + 120
    while not JobFolder(out).metrics.is_file() and time.time() < deadline:
        time.sleep(0.1)
    hosts[1].send_signal(signal.SIGINT)  # `ip netns exec` passes it on to the dlrm process
    results = [process.communicate(timeout=120) for process in hosts]
    assert hosts[1].returncode == 130 and hosts[0].returncode != 0, [err[-2000:] for _, err in results]
    assert "node 1: stopped by a signal" in results[0][1]
    leftovers = subprocess.run(["pgrep", "-f", f"{RANK_MODULE} {out}"], capture_output=True, text=True, check=False)
    assert leftovers.stdout.strip() == "", "no worker left on either host"
    ranks = [JobFolder(out).read_pid(rank) for rank in (0, 1)]  # forked by the warm-rank server, not torchrun's children
    assert all(pid is not None for pid in ranks)
    assert all_end(ranks, within_s=10), "no rank left either"


def _in_host(host: str, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", host, *command], env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)  # fmt: skip


def _wait_until_answers(host: str, url: str, process: subprocess.Popen, log: Path, path: str = "/health",
                        also: str = "/health") -> None:  # fmt: skip
    """Until the server at `url` (inside `host`'s namespace) answers `path` and `also`."""
    probe = (f"import httpx, sys; sys.exit(0 if all(httpx.get('{url}' + p, timeout=2).status_code == 200 "
             f"for p in ({path!r}, {also!r})) else 1)")
    deadline = time.time() + 120
    while time.time() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        if subprocess.run(["ip", "netns", "exec", host, sys.executable, "-c", probe], capture_output=True,
                          check=False).returncode == 0:  # fmt: skip
            return
        time.sleep(1)
    raise AssertionError(f"the Prefect server at {url} did not answer: {log.read_text()[-3000:]}")


def test_the_pipeline_trains_across_hosts_served_as_trainer_nodes(
    two_hosts: list[str], pipeline_run: tuple[Path, dict], tmp_path: Path
) -> None:
    """A Prefect server on host 0, `dlrm serve --trainer-node R` on each host, and the pipeline
    (on host 0) whose training stage runs on both, its calibration rows scored on both."""
    api = "http://10.201.7.1:4277/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # fmt: skip
    (tmp_path / "prefect").mkdir()
    copy_template_to(tmp_path / "prefect" / "prefect.db")  # as `dlrm server` starts its own: not 11 s of migrations
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    prepared_run, one_host = pipeline_run
    started = [_in_host(two_hosts[0], [sys.executable, "-m", "prefect", "server", "start", "--host", "10.201.7.1",
                                       "--port", "4277"], server_env, tmp_path / "server.log")]  # fmt: skip
    try:
        _wait_until_answers(two_hosts[0], api, started[0], tmp_path / "server.log")
        config = ["--config", str(ROOT / "configs" / "tiny.toml"), "--set", f'run_dir="{prepared_run}"']
        for rank, host in enumerate(two_hosts):
            started.append(_in_host(host, [*warm_commands.dlrm(), "serve", *config, "--trainer-node", str(rank)], env,
                                    tmp_path / f"node-{rank}.log"))  # fmt: skip
        _wait_until_answers(two_hosts[0], api, started[0], tmp_path / "server.log",
                            path="/deployments/name/train-node/node-1", also="/deployments/name/train-node/node-0")
        run = subprocess.run(["ip", "netns", "exec", two_hosts[0], *warm_commands.dlrm(), "run", *config,
                              "--set", "training.nproc=1",
                              "--set", "orchestration.trainer_hosts=2", "--set", f'orchestration.rdzv_endpoint="{ENDPOINT}"',
                              "--json"], env=env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:] + (tmp_path / "node-1.log").read_text()[-2000:]
        summary = _report(run.stdout)
    finally:
        for process in reversed(started):  # Ctrl-C, as a user stops them (tested in test_stopping.py)
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    # The pipeline holds 10 % of the rows out for its calibrator (as `dlrm train` does): both
    # hosts' ranks score their share of them, and the calibrator is fitted on every one.
    assert summary["world_size"] == 2 and summary["rows_trained"] + summary["calibration_rows"] == 12_000
    assert summary["steps"] == -(-summary["rows_trained"] // one_host["global_batch_size"])
    scored = sorted(JobFolder(prepared_run / "train").predictions(CALIBRATION_PART).glob("*.parquet"))
    assert len(scored) == 2, "each host's rank scored its share"
    assert sum(pq.read_metadata(path).num_rows for path in scored) == summary["calibration_rows"]
    assert JobFolder(prepared_run / "train").logs(1).is_dir(), "host 1 trained its part"
