"""bench/suite_cpu.py: the kinds it tells apart, and the CPU it charges a process that the
tests it runs start."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("suite_cpu", ROOT / "bench" / "suite_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["suite_cpu"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_each_process_of_the_suite_is_named_by_its_command_line() -> None:
    kind = _bench().process_kind
    venv = "/repo/.venv/bin/python"
    server = f"{venv} -m uvicorn --app-dir x --factory flows.stages.prefect_app:create_app --port 1"
    assert kind(server) == "temporary Prefect server"
    assert kind(f"{venv} -u -m training.worker /tmp/pytest-of-root/run/train/job.json") == "torchrun rank"
    assert kind(f"{venv} -u -m training.launch.rank /tmp/pytest-of-root/run/train/job.json") == "torchrun rank"
    assert kind(f"{venv} -m torch.distributed.run --nproc-per-node 2 -m training.launch.rank job.json") == "torchrun agent"
    assert kind(f"{venv} -m training.launch.agent --nproc-per-node 2 -m training.launch.rank job.json") == "torchrun agent"
    assert kind(f"{venv} -u -c import sys;exec(eval(sys.stdin.readline()))") == "test process (xdist worker)"
    assert kind(f"{venv} -m flows.cli run --config configs/tiny.toml --set run_dir=\"/tmp/pytest-of-root/x\"") == "dlrm command"
    assert kind("postgres: 15/main: postgres dlrm_tests_prefect_12 127.0.0.1(5) idle") == "PostgreSQL"
    assert kind(f"{venv} -c print(1) /tmp/pytest-of-root/test_two_workers_share_one_study_on_postgres0") == "other Python"
    preloaded = "from multiprocessing.forkserver import main; main(7, 8, ['torch', 'training.worker'])"
    assert kind(f"{venv} -c {preloaded}") == "multiprocessing forkserver or spawned process"
    assert kind("/usr/bin/xz -0 -T0 -c") == "xz (bundle parts)"
    assert kind("/usr/bin/sleep 5") == "other: sleep"


def test_a_process_a_test_starts_is_charged_the_cpu_it_used(tmp_path: Path) -> None:
    """One test that keeps a child busy for 1.5 s of CPU: the child is seen and charged
    about that, and the processes seen account for no more than the machine's busy time.
    The child is told apart by a mark on its command line: the bench charges every process
    on the machine, and other tests' processes may be running beside this one."""
    test_file = tmp_path / "test_busy_child.py"
    test_file.write_text(
        "import subprocess, sys\n"
        "def test_busy_child():\n"
        "    code = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.5: pass'\n"
        f"    assert subprocess.run([sys.executable, '-c', code, {str(tmp_path)!r}], check=False).returncode == 0\n"
    )
    result = _bench().measure([str(test_file)], workers=0, interval=0.1, mark=f"pass {tmp_path}")
    assert result["pytest_exit_code"] == 0
    assert 1.3 <= result["marked_core_s"] <= 1.8, result
    assert result["core_s_by_kind"]["other Python"] >= result["marked_core_s"] - 0.05, "the child is other Python"
    assert result["processes_by_kind"]["pytest (controller)"] >= 1  # the one it ran (and this test's own)
    assert result["processes_core_s"] <= result["machine_busy_core_s"] + 0.5, result


def test_a_process_started_through_sh_exec_is_named_by_what_it_execs_and_listed_among_the_largest(tmp_path: Path) -> None:
    """A node's commands start as `sh -c '… exec "$@"'` (tests/integration/slurm_cluster.py): a
    process first read as `sh` is read again, so it is charged under what it became, and
    `largest` lists it with that command line."""
    test_file = tmp_path / "test_wrapped_child.py"
    test_file.write_text(
        "import subprocess, sys\n"
        "def test_wrapped_child():\n"
        "    code = 'import time\\ntime.sleep(0.3)\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass'\n"
        "    wrapped = ['sh', '-c', 'sleep 0.3; exec \"$@\"', 'sh', sys.executable, '-c', code]\n"
        f"    assert subprocess.run([*wrapped, {str(tmp_path)!r}], check=False).returncode == 0\n"
    )
    result = _bench().measure([str(test_file)], workers=0, interval=0.1, largest=50)
    listed = [(seconds, kind) for seconds, kind, command in result["largest"] if str(tmp_path) in command and
              "process_time" in command]  # fmt: skip
    assert len(listed) == 1 and listed[0][1] == "other Python" and 0.8 <= listed[0][0] <= 1.4, result["largest"]
