"""The per-day data stages on a real Dask cluster: a `distributed` scheduler and two worker
processes on 127.0.0.1, started as a user would with the `dask` command."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import free_port

from flows.run.config import ConfigError

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASK = str(Path(sys.executable).parent / "dask")


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`dask scheduler` and two `dask worker`s (one thread each); yields the scheduler's address."""
    from distributed import Client

    address = f"tcp://127.0.0.1:{free_port()}"
    logs = tmp_path_factory.mktemp("dask-logs")
    port = address.rsplit(":", 1)[1]
    processes = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", port, "--no-dashboard"],
                                  stdout=subprocess.DEVNULL, stderr=(logs / "scheduler.log").open("w"))]  # fmt: skip
    processes += [
        subprocess.Popen([DASK, "worker", address, "--nthreads", "1", "--name", f"worker-{i}", "--no-dashboard"],
                         stdout=subprocess.DEVNULL, stderr=(logs / f"worker-{i}.log").open("w"))
        for i in (1, 2)
    ]
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
        yield address
    finally:
        # the scheduler ends its workers and itself: a worker sent SIGTERM waits out its
        # nanny's 8 s close now and then (measured: 0.2 s or 8.1 s, by chance)
        with contextlib.suppress(Exception), Client(address, timeout=10) as client:
            client.shutdown()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _tasks_run_by_worker(address: str) -> dict[str, int]:
    from distributed import Client

    with Client(address, timeout=60) as client:
        counts = client.run(lambda dask_worker: (dask_worker.name, dask_worker.state.executed_count))
    return dict(counts.values())


def test_the_data_stages_run_on_the_dask_workers(prefect_server, dask_cluster: str, tmp_path: Path) -> None:
    from flows.deployments.pipeline import run_pipeline

    before = _tasks_run_by_worker(dask_cluster)
    summary = run_pipeline(str(ROOT / "configs" / "tiny.toml"), [
        f'run_dir="{tmp_path}"', 'orchestration.task_runner="dask"', f'orchestration.dask_address="{dask_cluster}"',
    ])  # fmt: skip
    after = _tasks_run_by_worker(dask_cluster)
    ran = {name: after[name] - before.get(name, 0) for name in after}
    assert set(ran) == {"worker-1", "worker-2"}
    # generate, ingest and preprocess for each of 3 days: 9 tasks, on both workers
    assert sum(ran.values()) >= 9 and all(count > 0 for count in ran.values()), ran
    assert summary["rows_ingested"] == 18_000 and summary["eval_ne"] < 0.95


def test_workers_elsewhere_cannot_report_to_a_prefect_on_loopback() -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.stages.features import check_workers_reach_prefect

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        check_workers_reach_prefect("tcp://127.0.0.1:8786")  # workers on this host reach it
        with pytest.raises(ConfigError, match="cannot reach this flow's Prefect API"):
            check_workers_reach_prefect("tcp://192.0.2.10:8786")
    with temporary_settings({PREFECT_API_URL: "http://192.0.2.1:4200/api"}):
        check_workers_reach_prefect("tcp://192.0.2.10:8786")
