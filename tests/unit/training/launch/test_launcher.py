"""Reading torchrun's failure report (blame the worker that caused it); what of a job's
output a person sees; following the output while calling back on a timer."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from evaluation.config import EvaluationConfig
from training.config import ModelConfig, ShardingConfig, TrainingConfig
from training.job import TrainJob
from training.launch import launcher
from training.launch.launcher import follow, torchrun_command
from training.launch.output import ConsoleFilter, first_cause
from training.launch.warm_ranks import ENVIRONMENT_KEY, UNDER_TORCHRUN_KEY, client_command

REPORT = """
Failures:
[1]:
  time      : 2026-11-21_10:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5444)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_10:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5443)
"""


def test_a_killed_worker_is_blamed_not_the_one_torchrun_stopped() -> None:
    assert first_cause(REPORT) == (1, 1, -9)


def test_a_worker_that_raised_is_blamed_before_those_torchrun_stopped() -> None:
    report = REPORT.replace("exitcode  : -9", "exitcode  : -15").replace("exitcode  : -15 (pid: 5443)", "exitcode  : 1")
    assert first_cause(report) == (0, 0, 1)


def test_a_killed_worker_is_blamed_before_a_peer_that_raised_on_the_broken_connection() -> None:
    """Rank 1 was SIGKILLed; rank 0's next collective raised before torchrun stopped it."""
    assert first_cause(REPORT.replace("exitcode  : -15", "exitcode  : 1")) == (1, 1, -9)


def test_a_crashed_worker_is_blamed_before_the_peers_nccl_aborted() -> None:
    report = REPORT.replace("exitcode  : -9", "exitcode  : -11").replace("exitcode  : -15", "exitcode  : -6")
    assert first_cause(report) == (1, 1, -11)


def test_between_equal_causes_torchruns_first_observed_failure_is_blamed() -> None:
    report = REPORT.replace("exitcode  : -9", "exitcode  : 1").replace("exitcode  : -15", "exitcode  : 1")
    assert first_cause(report) == (0, 0, 1)


def test_no_report_means_no_cause() -> None:
    assert first_cause("Traceback: something else") is None


# What a two-process CPU job printed (torchrun 2.13, torchrec 1.8), in order.
JOB_OUTPUT = """\
[default0]:[train] CPU kernels: embedding_update cpu-fbgemm, interaction native
[default0]:WARNING:torchrec.distributed.planner.types:The topology was constructed directly rather than via TopologyFactory.create_topology().
[default0]:/work/main/.venv/lib/python3.11/site-packages/torchrec/distributed/planner/planners.py:552: FutureWarning: HeuristicalStorageReservation is known to cause issues.
[default0]:  else HeuristicalStorageReservation(
[default1]:/work/main/.venv/lib/python3.11/site-packages/torchrec/distributed/model_parallel.py:183: FutureWarning: `broadcast_buffers` is deprecated.
[default0]:[train] 2 processes on cpu (gloo); sharding plan:
[default1]:  DistributedDataParallel(
[default0]:[train]   table      sharding       kernel             ranks      MiB per rank
[default0]:[rank0]:W1124 19:22:55.384000 12062 torch/fx/_symbolic_trace.py:56] is_fx_tracing will return true for both
[default0]:[train] step 5/46 (11%) loss 0.5995 NE(window) 1.4515 3,424 samples/s ETA 3s
[default0]:[train] step 10/46 held-out NE 0.976537
[default1]:[rank1]: Traceback (most recent call last):
[default1]:[rank1]:   File "/work/main/training/worker.py", line 18, in <module>
[default1]:[rank1]: FileNotFoundError: missing.parquet
E1124 19:22:43.436000 11897 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1
[default0]:WARNING:training.worker:a warning of our own
[default0]:something nobody expected
"""
SHOWN = [
    "[default0]:[train] CPU kernels: embedding_update cpu-fbgemm, interaction native",
    "[default0]:[train] 2 processes on cpu (gloo); sharding plan:",
    "[default0]:[train]   table      sharding       kernel             ranks      MiB per rank",
    "[default0]:[train] step 5/46 (11%) loss 0.5995 NE(window) 1.4515 3,424 samples/s ETA 3s",
    "[default0]:[train] step 10/46 held-out NE 0.976537",
    "[default1]:[rank1]: Traceback (most recent call last):",
    '[default1]:[rank1]:   File "/work/main/training/worker.py", line 18, in <module>',
    "[default1]:[rank1]: FileNotFoundError: missing.parquet",
    "E1124 19:22:43.436000 11897 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1",
    "[default0]:WARNING:training.worker:a warning of our own",
    "[default0]:something nobody expected",
]


def test_the_console_shows_everything_but_the_libraries_warnings() -> None:
    shown = ConsoleFilter()
    assert [line for line in JOB_OUTPUT.splitlines() if shown(line)] == SHOWN


def _process(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def test_follow_streams_the_lines_and_polls_after_each_and_at_the_end() -> None:
    process = _process("print('[train] one'); print('/x/site-packages/a.py:1: UserWarning: w'); print('[train] two')")
    shown: list[str] = []
    polls = []
    output = follow(process, shown.append, lambda: polls.append(len(shown)), poll_s=30)
    assert process.wait() == 0
    assert shown == ["[train] one", "[train] two"] and len(output) == 3
    assert polls[-1] == 2 and len(polls) >= 4, "after each of 3 lines, and once at the end"


class _Pruned(Exception):
    """What a pruning callback raises to end the follow (the test checks it propagates)."""


def test_a_silent_job_is_polled_on_a_timer_and_a_poll_that_raises_ends_the_follow() -> None:
    """A pruner must act even while the job prints nothing (evaluating, checkpointing)."""
    process = _process("import time; print('[train] started'); time.sleep(60)")
    polls = []

    def poll() -> None:
        polls.append(time.monotonic())
        if len(polls) == 4:
            raise _Pruned

    started = time.monotonic()
    try:
        with pytest.raises(_Pruned):
            follow(process, lambda line: None, poll, poll_s=0.2)
        assert time.monotonic() - started < 10, "polled while the job was silent"
    finally:
        process.kill()
        process.wait()


def test_one_host_launches_from_a_named_warm_rank_server_unless_it_keeps_torchrun(tmp_path: Path, monkeypatch) -> None:
    job = TrainJob(model=ModelConfig(), sharding=ShardingConfig(), training=TrainingConfig(nproc=2),
                   evaluation=EvaluationConfig(), table_sizes={"t_C1": 10}, train_files=(), eval_files={},
                   out_dir=str(tmp_path / "job"))  # fmt: skip
    job_path, server = tmp_path / "job.json", tmp_path / "server.sock"
    monkeypatch.delenv(UNDER_TORCHRUN_KEY, raising=False)
    monkeypatch.delenv(ENVIRONMENT_KEY, raising=False)
    assert launcher._command(job, job_path, None) == torchrun_command(job, job_path, None), "no server: torchrun"
    monkeypatch.setenv(ENVIRONMENT_KEY, str(server))
    assert launcher._command(job, job_path, None) == client_command(server, job_path, 2, job.folder.logs(None))
    monkeypatch.setenv(UNDER_TORCHRUN_KEY, "1")  # the launcher's tests: torchrun, its ranks forked by the server
    assert launcher._command(job, job_path, None) == torchrun_command(job, job_path, None)
