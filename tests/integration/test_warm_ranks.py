"""Warm ranks (training/launch/warm_ranks.py), the launch the other test modules use: the
same job trains the same parameters as under torchrun, a failing rank is named as torchrun
names it, and a stopped or killed launch leaves no rank behind."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from process_tree import all_end, descendants
from tiny_jobs import tiny_job

from training.codec import encode
from training.job import TrainJob
from training.launch.host_role import free_local_port
from training.launch.launcher import TrainingFailed, launch, torchrun_command
from training.launch.warm_ranks import ENVIRONMENT_KEY, FIRST_USE_IMPORTS, client_command
from training.loop.checkpoint_chain import latest_checkpoint
from training.loop.progress import HeldoutRecord, MetricsRecord
from training.serving.export import export_model

pytestmark = pytest.mark.slow


def _job(features, out: Path) -> TrainJob:
    job = tiny_job(features, out, nproc=2, batch_size=256, embedding_lr=0.1, dense_lr=0.05, epochs=2,
                   log_every=5, checkpoint_every=10)  # fmt: skip
    return replace(job, evaluation=replace(job.evaluation, heldout_every_steps=10, heldout_batches=1))


def _saved_long_job(features, out: Path) -> TrainJob:
    """A job of a minute or more (it must be ended, not end), its job file written."""
    job = _job(features, out)
    job = replace(job, training=replace(job.training, epochs=60))
    job.out.mkdir(parents=True, exist_ok=True)
    job.save(job.folder.job_file())
    return job


def _server_pid(socket_path: Path) -> int:
    found = subprocess.run(["pgrep", "-f", f"warm_ranks serve {socket_path}"], capture_output=True, text=True, check=True)
    return int(found.stdout.split()[0])


def _no_rank_left(server: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while descendants(server):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _under_torchrun_with_forked_ranks(job: TrainJob, server: int) -> int:
    """`job` under a real torchrun whose ranks the warm-rank server forks (as on each host of
    a job across hosts); returns the most processes the server had at once (watchers and ranks)."""
    job.out.mkdir(parents=True, exist_ok=True)
    job.save(job.folder.job_file())
    env = {**os.environ, "OMP_NUM_THREADS": str(job.training.threads_per_proc)}
    torchrun = subprocess.Popen(torchrun_command(job, job.folder.job_file()), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    most = 0
    while torchrun.poll() is None:
        most = max(most, len(descendants(server)))
        time.sleep(0.02)
    assert torchrun.returncode == 0, torchrun.stdout.read()[-3000:]
    return most


def test_warm_ranks_train_exactly_what_torchrun_trains(tiny_features, tmp_path: Path, monkeypatch,
                                                       warm_rank_server: Path) -> None:  # fmt: skip
    """The same job three ways: the server standing in for torchrun, torchrun with each rank
    forked by the server (a host of a job across hosts, in the tests), torchrun as deployed."""
    warm = _job(tiny_features, tmp_path / "warm")
    launch(warm, on_line=lambda line: None)
    assert os.environ.get(ENVIRONMENT_KEY) and next(warm.folder.logs().glob("warm_*/attempt_0/1/stdout.log"))
    forked = _job(tiny_features, tmp_path / "forked")
    assert _under_torchrun_with_forked_ranks(forked, _server_pid(warm_rank_server)) >= 4, "two watchers, two ranks"
    assert next(forked.folder.logs().glob("*/attempt_0/1/stdout.log")), "torchrun's own log folders"
    monkeypatch.delenv(ENVIRONMENT_KEY)
    torchrun = _job(tiny_features, tmp_path / "torchrun")
    launch(torchrun, on_line=lambda line: None)
    assert not any(torchrun.folder.logs().glob("warm_*")), "torchrun's own log folders"
    theirs = encode(torchrun.folder.read_summary())
    torchrun_params = export_model(torchrun, latest_checkpoint(torchrun.checkpoint_root)).state_dict()
    for ours in (warm, forked):
        summary = encode(ours.folder.read_summary())
        for key in ("steps", "rows_trained", "rows_fingerprint", "world_size"):
            assert summary[key] == theirs[key], key
        params = export_model(ours, latest_checkpoint(ours.checkpoint_root)).state_dict()
        for name, value in torchrun_params.items():
            assert torch.equal(params[name], value), name
        predictions = ours.folder.read_predictions("2").predictions.tolist()
        assert predictions == torchrun.folder.read_predictions("2").predictions.tolist()


# A rank of one process, run as the server's ranks run (training.worker.main after the
# server's imports); prints the modules it imported itself.
_RANK_IMPORTS = """
import json, os, sys
from training.launch.warm_ranks import import_the_trainer
import_the_trainer()
before = set(sys.modules)
from training.worker import main
main([sys.argv[1]])
print(json.dumps(sorted(set(sys.modules) - before)))
sys.stdout.flush()
os._exit(0)
"""


def test_a_rank_imports_nothing_large_that_the_server_has_not(tiny_features, tmp_path: Path) -> None:
    """What a rank imports on first use is the server's import (FIRST_USE_IMPORTS): a job run
    after `import_the_trainer` imports a few small modules of its own (DCP's fsspec writer,
    about 15 ms), not pandas (about 300 modules), TorchRec's optimizers or this project's."""
    job = _job(tiny_features, tmp_path)
    job = replace(job, training=replace(job.training, nproc=1, epochs=1))
    job.out.mkdir(parents=True, exist_ok=True)
    job.save(job.folder.job_file())
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port())}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _RANK_IMPORTS, str(job.folder.job_file())], capture_output=True,
                          text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert job.folder.read_summary().steps > 0, "the rank trained"
    imported = json.loads(done.stdout.splitlines()[-1])
    own = [name for name in imported if name.split(".")[0] in {"pandas", "torchrec", "fbgemm_gpu", "training"}
           or name.startswith("torch.distributed.optim")]  # fmt: skip
    assert not own and len(imported) < 60, imported
    assert {"torch.distributed.optim", "pandas", "training.cpu"} <= set(FIRST_USE_IMPORTS)


def test_a_failing_rank_is_named_with_its_error(tiny_features, tmp_path: Path) -> None:
    job = replace(_job(tiny_features, tmp_path), train_files=(str(tmp_path / "missing.parquet"),))
    with pytest.raises(TrainingFailed) as caught:
        launch(job, on_line=lambda line: None)
    message = str(caught.value)
    assert message.startswith("training failed: rank ") and "exited with code 1" in message
    assert "missing.parquet" in message, "the end of the rank's log is shown"


class _StopHere(Exception):
    """Raised from the progress callback, as a pruned trial does."""


def test_a_stopped_launch_leaves_no_rank_behind(tiny_features, tmp_path: Path, warm_rank_server: Path) -> None:
    job = _job(tiny_features, tmp_path)

    def stop_at_first_heldout(record: MetricsRecord) -> None:
        if isinstance(record, HeldoutRecord):
            raise _StopHere(record)

    with pytest.raises(_StopHere):
        launch(job, on_line=lambda line: None, on_progress=stop_at_first_heldout)
    assert _no_rank_left(_server_pid(warm_rank_server)), "the stop reached the job's agent and every rank"
    assert not job.folder.summary_file.exists(), "the job did not run to its end"


def test_a_client_killed_outright_takes_its_ranks_with_it(tiny_features, tmp_path: Path, warm_rank_server: Path) -> None:
    job = _saved_long_job(tiny_features, tmp_path)
    server = _server_pid(warm_rank_server)
    client = subprocess.Popen(client_command(warm_rank_server, job.folder.job_file(), 2, job.folder.logs()),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while len(descendants(server)) < 3:  # the agent and its two ranks
        assert time.monotonic() < deadline and client.poll() is None, "the job started"
        time.sleep(0.05)
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert _no_rank_left(server, timeout_s=10), "a client killed outright leaves no rank training"
    assert not job.folder.summary_file.exists()


def test_a_torchrun_killed_outright_takes_its_forked_ranks_with_it(tiny_features, tmp_path: Path,
                                                                    warm_rank_server: Path) -> None:  # fmt: skip
    """The launcher kills torchrun outright when its parent ends first (a stopped flow run):
    each rank's stand-in dies with torchrun as a rank does, and its watcher ends the rank."""
    job = _saved_long_job(tiny_features, tmp_path)
    server = _server_pid(warm_rank_server)
    env = {**os.environ, "OMP_NUM_THREADS": str(job.training.threads_per_proc)}
    torchrun = subprocess.Popen(torchrun_command(job, job.folder.job_file()), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    deadline = time.monotonic() + 60
    while len(descendants(server)) < 4:  # two watchers and their ranks
        assert time.monotonic() < deadline and torchrun.poll() is None, "the job started"
        time.sleep(0.05)
    stand_ins = descendants(torchrun.pid)
    torchrun.send_signal(signal.SIGKILL)
    torchrun.wait()
    assert len(stand_ins) == 2 and all_end(stand_ins, within_s=10), "the stand-ins die with torchrun"
    assert _no_rank_left(server, timeout_s=10), "and their ranks with them"


def test_a_missing_server_is_one_line_naming_the_variable(tiny_features, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENVIRONMENT_KEY, str(tmp_path / "no-server.sock"))
    with pytest.raises(TrainingFailed) as caught:
        launch(_job(tiny_features, tmp_path / "run"), on_line=lambda line: None)
    assert f"unset {ENVIRONMENT_KEY}" in str(caught.value) and "no warm-rank server at" in str(caught.value)
    done = subprocess.run([sys.executable, "-m", "training.launch.warm_ranks", "bogus"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], check=False)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("usage:")
