"""`dlrm submit` and the pipeline on a real Slurm (Debian's slurmctld and two slurmd 22.05, each
node a network namespace of its own; tests/integration/slurm_cluster.py): a job over both nodes
trains what `dlrm train` trains on one host with as many processes, every row once; it resumes
from its checkpoint when Slurm requeues it; what Slurm refuses is one line; Ctrl-C on `--wait`
cancels the job and ends its processes on both nodes; and a retrain from the served
deployment with `orchestration.launcher = "slurm"` trains the same model as a batch job over
both nodes, its MLflow run naming the job; and a retune's trials train as batch jobs too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_commands
from mlflow.tracking import MlflowClient
from slurm_cluster import ClusterUnavailable, SlurmCluster, kill_node, restart_node, start_cluster, stop_cluster

from flows.run.config import load_config
from flows.tracking.runs import tracking_client
from training.launch.slurm_jobs import ENDED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
# three epochs of 47 steps, a checkpoint every 10: a requeue lands between checkpoints
LONGER = ["training.epochs=3", "training.checkpoint_every=10", "training.keep_checkpoints=20"]
# one process a node on Slurm's two nodes: the world of tiny's one host of 2 processes
ONE_A_NODE = ["training.nproc=1"]


def dlrm(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*warm_commands.dlrm(), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def head_dlrm(cluster: SlurmCluster, *args: str, warm: bool = True) -> list[str]:
    """`dlrm ARGS` on the cluster's head node: a warm command (tests/warm_commands.py), which
    runs in the head node's namespaces, or with `warm=False` a new interpreter."""
    return cluster.command(*(warm_commands.dlrm() if warm else [sys.executable, "-m", "flows.cli"]), *args)


def on_head(cluster: SlurmCluster, *args: str, warm: bool = True, **popen) -> subprocess.Popen:
    """`dlrm ARGS` started on the cluster's head node."""
    return subprocess.Popen(head_dlrm(cluster, *args, warm=warm), cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)  # fmt: skip


def sets(overrides: list[str]) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    try:
        cluster, daemons = start_cluster(tmp_path_factory.mktemp("slurm"), cpus=os.cpu_count() or 2)
    except ClusterUnavailable as why:
        pytest.skip(str(why))
    yield cluster
    stop_cluster(daemons)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict]:
    """A run folder with tiny's features, and `dlrm train`'s report of the longer job run
    directly on one host (2 processes, no Slurm), into a folder of its own."""
    run_dir = tmp_path_factory.mktemp("shared-run")
    overrides = [f'run_dir="{run_dir}"', *LONGER]
    steps = [("generate", "--config", TINY, *sets(overrides)),
             ("ingest", *(str(run_dir / "raw" / f"day_{day}.tsv.gz") for day in (0, 1, 2)), "--warehouse",
              str(run_dir / "warehouse")),  # each file's day from its name
             ("preprocess", "--config", TINY, *sets(overrides))]  # fmt: skip
    for step in steps:
        done = dlrm(*step)
        assert done.returncode == 0, (step, done.stderr[-3000:])
    direct = dlrm("train", "--config", TINY, *sets(overrides), "--out", str(run_dir / "direct"), "--json")
    assert direct.returncode == 0, direct.stderr[-3000:]
    return overrides, json.loads(direct.stdout.strip().splitlines()[-1])


def _tail(path: Path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path.name} missing)"


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "train" / "checkpoints").glob("*/step-*/meta.json"))


def test_a_lost_node_requeues_the_job_which_resumes_and_ends_as_one_host_never_stopped(slurm: SlurmCluster,
                                                                                       prepared) -> None:  # fmt: skip
    """`dlrm submit --nodes 2 --wait`, node 1 killed after the job's first checkpoint (its
    slurmd, the step's daemon and the training process): Slurm marks the node down and
    requeues the job (`--requeue`), and `--wait` names the lost node. Once the node is back,
    the job runs again on both nodes, resumes from its checkpoint, and ends where one host's
    uninterrupted run ends: the same rows, steps and NE. (A requeue by hand, `scontrol
    requeue`, restarts the batch script the same way.)"""
    overrides, direct = prepared
    run_dir = Path(overrides[0].split('"')[1])
    started = time.time()
    submit = on_head(slurm, "submit", "--config", TINY, *sets([*overrides, *ONE_A_NODE]), "--nodes", "2", "--wait", "--json")
    told = []
    for line in submit.stderr:
        told.append(line)
        if "submitted" in line:
            break
    job_id = told[-1].split("Slurm job ")[1].split()[0]
    deadline = time.monotonic() + 300
    while not [c for c in _checkpoints(run_dir) if c.stat().st_mtime > started] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kill_node("dlrm-sn1") >= 3, "slurmd, the step's daemon and the node's training processes"
    killed = time.monotonic()
    for line in submit.stderr:  # the node stays lost until `--wait` has told the requeue
        told.append(line)
        if "restart 1" in line:
            break
    requeued_s = time.monotonic() - killed
    assert "node dlrm-sn1 DOWN" in told[-1], "".join(told)
    restart_node(slurm, "dlrm-sn1")
    back = time.monotonic()
    owed = _eligible_once_the_nodes_are_idle(slurm, job_id)
    stdout, stderr = submit.communicate(timeout=600)
    ended_s = time.monotonic() - back
    nodes = [(run_dir / "slurm" / f"{job_id}-node{rank}.out").read_text() for rank in (0, 1)]
    batch_log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert submit.returncode == 0, "\n".join([
        "".join(told) + stderr[-2000:], "--- the batch script's log:", batch_log[-1500:],
        "--- node 0:", nodes[0][-2000:], "--- node 1:", nodes[1][-1500:],
        "--- slurmd on node 1:", _tail(slurm.folder / "slurmd-dlrm-sn1.log", 1000),
        "--- owed to node 1 when the hold was lifted:", owed or "nothing"])  # fmt: skip
    report = json.loads(stdout.strip().splitlines()[-1])
    print(f"node lost → requeue told: {requeued_s:.0f} s; node back → job ended: {ended_s:.0f} s; job {job_id} ended "
          f"{report['state']} after {report['restarts']} restart(s), the hold lifted with {'a message' if owed else 'nothing'} "
          f"owed to the lost node; eval NE {report['eval_ne']} (one host: {direct['eval_ne']})")
    assert report["job_id"] == job_id and report["state"] == "COMPLETED" and report["exit_code"] == "0:0"
    assert report["restarts"] >= 1, "".join(told) + stderr
    script = Path(report["script"])
    assert script.parent == run_dir / "slurm" and "srun" in script.read_text() and "--nodes=2" in script.read_text()
    assert "[train] resuming from" in nodes[0], "the job went on from its checkpoint"
    assert all(node.count(f"node {rank} of 2: rendezvous") == 2 for rank, node in enumerate(nodes)), "both nodes ran twice"
    trained = report["train"]
    assert trained["resumed_from_step"] > 0
    assert trained["world_size"] == direct["world_size"] == 2
    for key in ("rows_trained", "steps", "global_batch_size"):
        assert trained[key] == direct[key], key
    assert report["eval_ne"] == pytest.approx(direct["eval_ne"], abs=1e-6), "two nodes, requeued, equal one host never stopped"


# Lifted within a second of the node's return, the relaunch's srun saw a stale allocation of
# one node ("SLURM_JOB_NUM_NODES … conflicts with allocated node count (2 != 1)") in 3 of 4
# tries; 5 s after both nodes were idle, 3 of 3 ran; twice that is the margin.
SETTLE_S = 10.0


def _eligible_once_the_nodes_are_idle(cluster: SlurmCluster, job_id: str) -> str:
    """Slurm holds a requeued job back for two minutes before it may start again (its begin
    time; measured 144 s from requeue to the next allocation). The test makes it eligible
    sooner, as an administrator would (`scontrol update … StartTime=now`), once the node is back
    in service, both nodes are idle and the job is pending, then SETTLE_S later. What the
    controller still owes the lost node from the first run (`sdiag`'s pending RPCs: the signal
    node 0's srun asked for when its peer vanished, retried a minute after it was queued) is
    returned: the relaunch must survive it (the batch script gives each run's training a step
    id of its own)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        idle = all("State=IDLE " in cluster.scontrol("show", "node", "--oneliner", n) for n in cluster.nodes)
        if idle and cluster.job_state(job_id) == "PENDING":
            time.sleep(SETTLE_S)
            owed = cluster.pending_rpcs()
            cluster.scontrol("update", f"JobId={job_id}", "StartTime=now")
            return owed
        if cluster.job_state(job_id) in ("RUNNING", *ENDED):
            return ""
        time.sleep(0.5)
    return ""


def test_what_slurm_refuses_is_one_line(slurm: SlurmCluster, prepared) -> None:
    overrides, _ = prepared
    done = subprocess.run(head_dlrm(slurm, "submit", "--config", TINY, *sets(overrides), "--partition", "no-such-partition"),
                          cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("dlrm: error: sbatch ") and len(done.stderr.strip().splitlines()) == 1
    assert "invalid partition" in done.stderr.lower() and "Traceback" not in done.stderr


def _training_processes(run_dir: Path) -> list[str]:
    """The command lines of this run folder's `dlrm train` processes, on either node."""
    listed = subprocess.run(["ps", "-ewwo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line for line in listed if str(run_dir) in line and " train " in line and "submit" not in line]


def test_ctrl_c_on_wait_cancels_the_job_and_its_processes_on_both_nodes(slurm: SlurmCluster, prepared) -> None:
    overrides, _ = prepared
    run_dir = Path(overrides[0].split('"')[1])
    long_enough = [*overrides, *ONE_A_NODE, "training.epochs=30"]  # still running when Ctrl-C comes
    process = on_head(slurm, "submit", "--config", TINY, *sets(long_enough), "--nodes", "2", "--wait",
                      warm=False)  # the command's own stop, as a user's terminal sends it
    job_id, lines = None, []
    for line in process.stderr:
        lines.append(line)
        if "submitted" in line:
            job_id = line.split("Slurm job ")[1].split()[0]
        if ": RUNNING" in line:
            break
    assert job_id is not None, "".join(lines)
    deadline = time.monotonic() + 120
    while len(_training_processes(run_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)  # both nodes' `dlrm train` started
    assert len(_training_processes(run_dir)) >= 2, "".join(lines)
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 130, "".join(lines) + rest
    assert f"Slurm job {job_id} cancelled" in rest
    deadline, state = time.monotonic() + 60, ""
    while time.monotonic() < deadline and (state not in ENDED or _training_processes(run_dir)):
        state = slurm.job_state(job_id)
        time.sleep(0.5)
    assert state == "CANCELLED", slurm.scontrol("show", "job", job_id)
    assert _training_processes(run_dir) == [], "every process of the job ended, on both nodes"


def _finished_run_with_a_slurm_job(client: MlflowClient, experiment: str):
    """The pipeline's MLflow run that a Slurm job trained, once it has finished (None before)."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], "tags.`training.slurm_job_id` != ''")
    return next((run for run in runs if run.info.status == "FINISHED"), None)


def test_a_retrain_from_the_dashboard_trains_as_a_slurm_job_over_both_nodes(slurm: SlurmCluster, prepared,
                                                                             tmp_path: Path) -> None:  # fmt: skip
    """`dlrm serve --with-server` on the head node with the Slurm launcher, and the retrain
    deployment run as the UI's button runs it: the flow run's training stage submits a job of
    two nodes and waits for it, then evaluates, registers and tracks the model, which equals
    the one `dlrm train` trains on one host with as many processes."""
    overrides, direct = prepared
    # policy "off": under the default a retrain of an untuned key schedules a retune, which this
    # serving process would start, and the stop would cut short, in the study the retune test joins
    on_slurm = [*overrides, *ONE_A_NODE, 'orchestration.launcher="slurm"', "orchestration.trainer_hosts=2",
                "orchestration.slurm.poll_s=1", 'tuning.policy="off"']  # fmt: skip
    env = {key: value for key, value in slurm.env.items() if not key.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"  # the button's run picked up within 2 s, not Prefect's 10
    port, log = 4391, tmp_path / "serve.log"  # in the head node's own network namespace: free
    serve = subprocess.Popen(head_dlrm(slurm, "serve", "--config", TINY, *sets(on_slurm), "--with-server", "--port", str(port)),
                             cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    config = load_config(TINY, on_slurm)
    client = tracking_client(config.tracking_uri)  # the store serve's retrain makes, made as it makes it
    try:
        deadline = time.monotonic() + 240
        while "prefect deployment run" not in log.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        started = subprocess.run(slurm.command(sys.executable, "-m", "prefect", "deployment", "run", "retrain/retrain"),
                                 env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}, capture_output=True,
                                 text=True, timeout=120, check=False)  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        deadline = time.monotonic() + 420
        while (run := _finished_run_with_a_slurm_job(client, config.tracking.experiment)) is None:
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1.0)
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
    job_id = run.data.tags["training.slurm_job_id"]
    text = log.read_text()
    assert f"Slurm job {job_id} submitted (2 node(s)" in text and f"Slurm job {job_id}: COMPLETED" in text, text[-3000:]
    assert "node 1 of 2: rendezvous at dlrm-sn0:" in (config.path("slurm") / f"{job_id}-node1.out").read_text()
    assert run.data.tags["training.world_size"] == "2"
    assert run.data.metrics["eval_ne"] == pytest.approx(direct["eval_ne"], abs=1e-6), "the model `dlrm train` trains"
    versions = client.search_model_versions(f"name='{config.tracking.registered_model}'")
    assert run.info.run_id in {version.run_id for version in versions}, "the retrain registered its model"


def test_a_retunes_trials_and_its_comparison_train_as_slurm_jobs_over_both_nodes(slurm: SlurmCluster, prepared,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    """`dlrm retune` with `orchestration.launcher = "slurm"` on the head node: every trial, and
    the runs that judge the best trial against the configured values, is a batch job over both
    nodes that the study follows (its held-out NE reaches the trial's MLflow run)."""
    overrides, _ = prepared
    on_slurm = [*overrides, *ONE_A_NODE, "training.epochs=1", 'orchestration.launcher="slurm"',
                "orchestration.trainer_hosts=2", "orchestration.slurm.poll_s=1"]  # fmt: skip
    env = {key: value for key, value in slurm.env.items() if not key.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    started = time.time()
    done = subprocess.run(head_dlrm(slurm, "retune", "--config", TINY, *sets(on_slurm), "--trials", "1", "--json"),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["trials_run_here"]) == 1 and report["best_ne"] is not None and report["decision"], report
    config = load_config(TINY, on_slurm)
    scripts = sorted(config.path("slurm").glob("dlrm-tiny-trial-*.sbatch"))
    assert [path.name.split("-seed")[0] for path in scripts] == [
        f"dlrm-tiny-trial-{number:04d}" for number in report["trials_run_here"]]
    assert all("--nodes=2" in path.read_text() and "a study's validation run" in path.read_text() for path in scripts)
    assert sorted(config.path("slurm").glob("dlrm-tiny-decision-*.sbatch")), "the comparison runs on Slurm too"
    # node 1's log of each of the three jobs: the trial, then the configured values and the trial
    # retrained to judge them (the earlier tests' jobs left theirs in the same folder)
    logs = [log for log in config.path("slurm").glob("*-node1.out") if log.stat().st_mtime >= started]
    assert len(logs) == 3 and all("node 1 of 2: rendezvous at" in log.read_text() for log in logs)
    client = MlflowClient(config.tracking_uri)
    trials = client.search_runs([client.get_experiment_by_name(config.tracking.experiment).experiment_id],
                                "tags.`tuning.trial` != ''")  # fmt: skip
    assert len(trials) == 1 and all(client.get_metric_history(run.info.run_id, "heldout_ne") for run in trials)
