"""The test suite's own rules: pytest imports each test file by its base name (the folders
have no `__init__.py`), so two files of one name anywhere under tests/ stop the whole
collection; `make test-fast` takes only the modules that are not marked slow; and each test
process shares the cores as tests/core_share.py says."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import core_share
import pytest
import torch
from core_share import share_of_the_cores

TESTS = Path(__file__).resolve().parents[2]
ROOT = TESTS.parent


def duplicate_names(files: list[Path]) -> list[str]:
    counts = Counter(path.name for path in files if path.name != "conftest.py")
    return sorted(name for name, count in counts.items() if count > 1)


def test_no_two_test_files_share_a_name() -> None:
    assert duplicate_names(sorted(TESTS.rglob("*.py"))) == []


def test_the_rule_finds_a_name_used_twice() -> None:
    files = [Path("a/test_slurm.py"), Path("b/test_slurm.py"), Path("a/conftest.py"), Path("b/conftest.py")]
    assert duplicate_names(files) == ["test_slurm.py"]


STARTS_PROCESSES = re.compile(r"prefect_server|torchrun|\bstart\(|run_pipeline|subprocess")
WHOLE_MODULE_SLOW = re.compile(r"^pytestmark = (?:\[[^\]]*pytest\.mark\.slow[^\]]*\]|pytest\.mark\.slow)", re.MULTILINE)


def unmarked_end_to_end(modules: list[Path]) -> list[str]:
    """The modules that start processes or servers and are not marked slow as a whole."""
    return [path.name for path in modules
            if STARTS_PROCESSES.search(path.read_text()) and not WHOLE_MODULE_SLOW.search(path.read_text())]  # fmt: skip


def test_every_integration_module_that_starts_processes_is_marked_slow() -> None:
    """An end-to-end module (a Prefect server, torchrun, a `dlrm` command) left unmarked would
    run in `make test-fast`, the development loop's two minutes."""
    assert unmarked_end_to_end(sorted((TESTS / "integration").glob("test_*.py"))) == []


def test_the_rule_finds_a_module_marked_slow_test_by_test_only(tmp_path: Path) -> None:
    one_test = tmp_path / "test_one.py"
    one_test.write_text("import subprocess\n\n@pytest.mark.slow\ndef test_x(prefect_server): ...\n")
    listed = tmp_path / "test_listed.py"
    listed.write_text("pytestmark = [\n    pytest.mark.gpu,\n    pytest.mark.slow,\n]\nimport subprocess\n")
    assert unmarked_end_to_end([one_test, listed]) == ["test_one.py"]


def test_make_test_fast_runs_every_test_not_marked_slow() -> None:
    """The README's development loop: the Makefile target selects by the mark, not by folder."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-fast:", 1)[1].split("\n\n", 1)[0]
    assert "pytest" in recipe and '-m "not slow"' in recipe and "tests/" not in recipe
    assert "make test-fast" in (ROOT / "README.md").read_text()


def test_each_test_process_keeps_its_cores_and_gives_what_it_starts_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest-xdist a test process's torch runs on every core (its threads waiting
    passively, a setting that must not reach the processes it starts), and what it starts
    inherits its share of the cores (tests/core_share.py)."""
    cores = len(os.sched_getaffinity(0))
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not core_share.developers_own:
        assert core_share.shared, "applied before torch was imported (tests/conftest.py)"
        assert os.environ["OMP_NUM_THREADS"] == str(share_of_the_cores()), "what this process starts takes its share"
        assert torch.get_num_threads() == cores and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert share_of_the_cores() == max(1, cores // 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(cores * 4))
    assert share_of_the_cores() == 1
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert share_of_the_cores() is None
