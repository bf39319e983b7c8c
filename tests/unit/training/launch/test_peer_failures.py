"""What a host of a job across hosts says when the job fails: a rank of its own killed from
outside is the cause, whichever host wrote its failure first; a failure of its ranks that
another host's explains is that host's (written before this host's torchrun ended, or up to
the grace after); a torchrun still running after the grace is stopped. torchrun is a shell
stand-in here (the mock the names say): the real one runs across simulated hosts in
tests/integration/test_multi_host.py."""

from __future__ import annotations

import shlex
import threading
import time
from pathlib import Path

import pytest

from evaluation.config import EvaluationConfig
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch import launcher
from training.launch.host_role import HostRole
from training.launch.launcher import PEER_GRACE_S, PeerFailed, TrainingFailed, launch

NODE = 1  # the host under test; node 0 is the other one, whose failure mark the test writes
PEER_SAID = "training failed: rank 0 exited with code 1"


def _report(exit_code: int) -> str:
    """torchrun's failure report of this host's one rank (rank 1)."""
    return ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-07_10:00:00\n  host      : node1\n"
            f"  rank      : 1 (local_rank: 0)\n  exitcode  : {exit_code} (pid: 4242)\n")  # fmt: skip


def _job(out: Path) -> TrainJob:
    return TrainJob(model=ModelConfig(embedding_dim=8, bottom_mlp=(8, 8), top_mlp=(8, 1)), sharding=ShardingConfig(),
                    training=TrainingConfig(nproc=1, batch_size=8, epochs=1), evaluation=EvaluationConfig(),
                    table_sizes={"C1": 10}, train_files=("unused.parquet",), eval_files={}, out_dir=str(out),
                    run_id="peers", hosts=2)  # fmt: skip


def _launch_with_stand_in(job: TrainJob, script: str, monkeypatch: pytest.MonkeyPatch, peer_after_s: float | None) -> None:
    """`launch` as node 1 of 2 with `script` (sh) in torchrun's place, once it has made its
    attempt's log folder; node 0's failure written `peer_after_s` after the start (None: never)."""
    attempt = job.folder.logs(NODE) / "stand-in" / "attempt_0"
    command = ["sh", "-c", f"mkdir -p {shlex.quote(str(attempt))}; {script}"]
    monkeypatch.setattr(launcher, "_command", lambda *_: command)
    if peer_after_s is not None:
        timer = threading.Timer(peer_after_s, job.folder.record_failure, (0, PEER_SAID))
        timer.start()
    launch(job, on_line=lambda line: None, poll_s=0.1, role=HostRole(nnodes=2, node_rank=NODE, endpoint="127.0.0.1:1"))


def test_with_a_stand_in_torchrun_a_rank_killed_here_is_named_though_the_other_host_wrote_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path / "run")
    with pytest.raises(TrainingFailed) as caught:
        _launch_with_stand_in(job, f"sleep 0.5; printf %s {shlex.quote(_report(-9))}; exit 1", monkeypatch, 0.0)
    assert not isinstance(caught.value, PeerFailed), str(caught.value)
    assert "rank 1 was killed by SIGKILL" in str(caught.value) and "node 1 of 2" in str(caught.value)
    assert "SIGKILL" in (job.folder.peer_failure(0, 2) or ""), "written for the other host to name"


def test_with_a_stand_in_torchrun_ranks_that_failed_here_first_name_the_other_hosts_later_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path / "run")
    with pytest.raises(PeerFailed) as caught:
        _launch_with_stand_in(job, f"printf %s {shlex.quote(_report(1))}; exit 1", monkeypatch, 1.0)
    assert f"training failed on another host (node 0: {PEER_SAID})" in str(caught.value)
    assert job.folder.peer_failure(0, 2) is None, "nothing of its own written: the other host's failure explains it"


def test_with_a_stand_in_torchrun_a_failure_no_other_host_explains_is_its_own_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path / "run")
    began = time.monotonic()
    with pytest.raises(TrainingFailed) as caught:
        _launch_with_stand_in(job, f"printf %s {shlex.quote(_report(1))}; exit 1", monkeypatch, None)
    assert not isinstance(caught.value, PeerFailed) and "rank 1 exited with code 1" in str(caught.value)
    assert time.monotonic() - began >= PEER_GRACE_S


def test_with_a_stand_in_torchrun_one_still_running_after_the_grace_is_stopped_and_the_peer_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path / "run")
    began = time.monotonic()
    with pytest.raises(PeerFailed) as caught:
        _launch_with_stand_in(job, "sleep 60", monkeypatch, 0.0)
    assert PEER_GRACE_S <= time.monotonic() - began < 30, "stopped once the grace was over, not at its own end"
    assert f"training failed on another host (node 0: {PEER_SAID})" in str(caught.value)
    assert "node 1 of 2; run the same command on every host to resume" in str(caught.value)


def test_with_a_stand_in_torchrun_a_part_that_ended_well_still_fails_when_the_other_host_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path / "run")
    with pytest.raises(PeerFailed) as caught:
        _launch_with_stand_in(job, "sleep 0.3; exit 0", monkeypatch, 0.0)
    assert "training failed on another host (node 0:" in str(caught.value)
