"""Reading torchrun's failure report: blame the worker that caused it."""

from training.launcher import first_cause

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
