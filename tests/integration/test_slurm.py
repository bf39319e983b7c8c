"""`dlrm submit` on a real Slurm (Debian's slurmctld and slurmd 22.05, one node; tests/integration/
slurm_cluster.py): the job trains what `dlrm train` trains, resumes from its checkpoint when
Slurm requeues it, says what Slurm refused in one line, and Ctrl-C on `--wait` cancels it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, start_cluster, stop_cluster

from training.launch.slurm_jobs import ENDED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
# three epochs of 47 steps, a checkpoint every 10: a requeue lands between checkpoints
LONGER = ["training.epochs=3", "training.checkpoint_every=10", "training.keep_checkpoints=20"]


def dlrm(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def sets(overrides: list[str]) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    cluster, daemons = start_cluster(tmp_path_factory.mktemp("slurm"), cpus=os.cpu_count() or 2)
    yield cluster
    stop_cluster(daemons)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict]:
    """A run folder with tiny's features, and `dlrm train`'s report of the longer job run
    directly (no Slurm), into a folder of its own."""
    run_dir = tmp_path_factory.mktemp("shared-run")
    overrides = [f'run_dir="{run_dir}"', *LONGER]
    steps = [("generate", "--config", TINY, *sets(overrides)),
             *(("ingest", str(run_dir / "raw" / f"day_{day}.tsv.gz"), "--warehouse", str(run_dir / "warehouse"), "--day",
                str(day)) for day in (0, 1, 2)),
             ("preprocess", "--config", TINY, *sets(overrides))]  # fmt: skip
    for step in steps:
        done = dlrm(*step)
        assert done.returncode == 0, (step, done.stderr[-3000:])
    direct = dlrm("train", "--config", TINY, *sets(overrides), "--out", str(run_dir / "direct"), "--json")
    assert direct.returncode == 0, direct.stderr[-3000:]
    return overrides, json.loads(direct.stdout.strip().splitlines()[-1])


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "train" / "checkpoints").glob("*/step-*/meta.json"))


def test_a_requeued_job_resumes_and_trains_what_dlrm_train_trains(slurm: SlurmCluster, prepared) -> None:
    overrides, direct = prepared
    run_dir = Path(overrides[0].split('"')[1])
    submitted = dlrm("submit", "--config", TINY, *sets(overrides), "--json", env=slurm.env)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    report = json.loads(submitted.stdout.strip().splitlines()[-1])
    job_id, script = report["job_id"], Path(report["script"])
    assert report["state"] == "SUBMITTED" and script.parent == run_dir / "slurm" and "srun" in script.read_text()
    deadline = time.monotonic() + 300
    while not _checkpoints(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _checkpoints(run_dir), slurm.scontrol("show", "job", job_id)
    requeued = subprocess.run(["scontrol", "requeue", job_id], env=slurm.env, capture_output=True, text=True, check=False)
    assert requeued.returncode == 0, requeued.stderr
    from training.launch.slurm_jobs import follow

    os.environ["SLURM_CONF"] = str(slurm.conf)  # follow() calls scontrol from this process
    try:
        final = follow(job_id, lambda state: None, poll_s=1.0)
    finally:
        del os.environ["SLURM_CONF"]
    node0 = (run_dir / "slurm" / f"{job_id}-node0.out").read_text()
    assert final.state == "COMPLETED" and final.exit_code == "0:0" and final.restarts >= 1, (final, node0[-3000:])
    assert "[train] resuming from" in node0, "the requeued job went on from its checkpoint"
    trained = json.loads([line for line in node0.splitlines() if line.startswith("{")][-1])
    for key in ("rows_trained", "steps", "global_batch_size"):
        assert trained[key] == direct[key], key
    assert trained["eval_ne"] == pytest.approx(direct["eval_ne"], abs=1e-6), "a resumed run equals one never stopped"


def test_what_slurm_refuses_is_one_line(slurm: SlurmCluster, prepared) -> None:
    overrides, _ = prepared
    done = dlrm("submit", "--config", TINY, *sets(overrides), "--partition", "no-such-partition", env=slurm.env)
    assert done.returncode == 2 and done.stderr.startswith("dlrm: error: sbatch ") and len(done.stderr.strip().splitlines()) == 1
    assert "invalid partition" in done.stderr.lower() and "Traceback" not in done.stderr


def test_ctrl_c_on_wait_cancels_the_job(slurm: SlurmCluster, prepared) -> None:
    overrides, _ = prepared
    command = [sys.executable, "-m", "flows.cli", "submit", "--config", TINY, *sets(overrides), "--wait"]
    process = subprocess.Popen(command, cwd=ROOT, env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id, lines = None, []
    for line in process.stderr:
        lines.append(line)
        if "submitted" in line:
            job_id = line.split("Slurm job ")[1].split()[0]
        if ": RUNNING" in line:
            break
    assert job_id is not None, "".join(lines)
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 130, "".join(lines) + rest
    assert f"Slurm job {job_id} cancelled" in rest
    deadline, state = time.monotonic() + 60, ""
    while time.monotonic() < deadline and state not in ENDED:
        state = slurm.scontrol("show", "job", "--oneliner", job_id).split("JobState=")[1].split()[0]
        time.sleep(0.5)
    assert state == "CANCELLED", slurm.scontrol("show", "job", job_id)
