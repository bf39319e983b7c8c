"""Shared fixtures: tiny generated days, built once per session and reused read-only."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

from core_share import share_the_cores
from waiting_apart import WaitingModulesApart, scheduler_for
from xdist.remote import Producer

from flows.stages.prefect_defaults import apply_prefect_defaults

# Before Prefect is imported anywhere: the same local-server settings as the `dlrm` command,
# and the tests' own servers, never one a developer's shell points at.
apply_prefect_defaults()
os.environ.pop("PREFECT_API_URL", None)
# Flows refuse data paths outside their run folder unless allowed: tests run in temp folders.
os.environ.setdefault("DLRM_DATA_DIRS", tempfile.gettempdir())

share_the_cores()  # before torch is imported anywhere (tests/core_share.py says why)

import pytest

from ingestion.config import PreprocessConfig, SyntheticConfig
from ingestion.preprocess import PreprocessState, apply_state, fit_state
from ingestion.synthetic import GroundTruth, generate_day
from ingestion.warehouse import ingest_day

TINY_SYNTHETIC = SyntheticConfig(rows_per_day=6000, seed=11, cardinality_scale=0.001)
TINY_PREPROCESS = PreprocessConfig(hash_size=2000, categorical_mode="hash", duckdb_threads=1, row_group_size=2048)
TINY_DAYS = (0, 1, 2)


@pytest.fixture(scope="session")
def tiny_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generated Criteo-format days (6,000 rows each) with their stats files."""
    raw = tmp_path_factory.mktemp("raw")
    truth = GroundTruth(TINY_SYNTHETIC)
    for day in TINY_DAYS:
        generate_day(TINY_SYNTHETIC, day, raw, truth)
    return raw


@pytest.fixture(scope="session")
def tiny_warehouse(tiny_raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    warehouse = tmp_path_factory.mktemp("warehouse")
    for day in TINY_DAYS:
        ingest_day([str(tiny_raw / f"day_{day}.tsv.gz")], day, warehouse)
    return warehouse


@pytest.fixture(scope="session")
def tiny_features(tiny_warehouse: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[PreprocessState, dict[int, list[str]]]:
    """The preprocessing state fitted on days 0–1 and every day's feature files."""
    return _fit_and_apply(tiny_warehouse, tmp_path_factory.mktemp("features"))


def _fit_and_apply(warehouse: Path, root: Path) -> tuple[PreprocessState, dict[int, list[str]]]:
    """The tiny hash-mode state fitted on days 0–1, applied to every day."""
    state = fit_state(TINY_PREPROCESS, warehouse, root, (0, 1))
    files = {
        day: [str(p) for p in sorted(apply_state(TINY_PREPROCESS, state, warehouse, root, day).glob("*.parquet"))]
        for day in TINY_DAYS
    }
    return state, files


TINY_MULTI_HOT = ("C3", "C12")
TINY_MULTI_HOT_SYNTHETIC = SyntheticConfig(rows_per_day=4000, seed=12, cardinality_scale=0.001, multi_hot_mean_ids=4.0)


@pytest.fixture(scope="session")
def multi_hot_warehouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generated days whose C3 and C12 are bags of ids (4 on average), ingested."""
    raw, warehouse = tmp_path_factory.mktemp("mh-raw"), tmp_path_factory.mktemp("mh-warehouse")
    truth = GroundTruth(TINY_MULTI_HOT_SYNTHETIC, TINY_MULTI_HOT)
    for day in TINY_DAYS:
        generate_day(TINY_MULTI_HOT_SYNTHETIC, day, raw, truth)
        ingest_day([str(raw / f"day_{day}.tsv.gz")], day, warehouse, multi_hot=TINY_MULTI_HOT)
    return warehouse


@pytest.fixture(scope="session")
def multi_hot_features(multi_hot_warehouse: Path, tmp_path_factory: pytest.TempPathFactory):
    """The hash-mode state fitted on days 0–1 of the multi-hot days, and every day's files."""
    return _fit_and_apply(multi_hot_warehouse, tmp_path_factory.mktemp("mh-features"))


# Seconds each module took in `make test` on a 2-core machine, two modules at once (measured,
# rounded; only an order). `make test` runs modules in two processes, each taking the next
# module as it finishes one: the longest first, so that no long module starts last and runs
# alone.
MODULE_SECONDS = {
    "test_on_slurm.py": 180, "test_stopping.py": 135, "test_multi_host.py": 85, "test_recurring.py": 65,
    "test_sharded_training.py": 65, "test_production_stack.py": 55, "test_bundle_round_trip.py": 50,
    "test_pipeline_flow.py": 50, "test_retune_flow.py": 45, "test_checkpoint_recovery.py": 45, "test_own_warehouse.py": 40,
    "test_id_churn.py": 35, "test_characterize.py": 35, "test_tracking_outage.py": 35, "test_cli.py": 30,
    "test_tuning_study.py": 25, "test_dask_runner.py": 25, "test_model.py": 20, "test_small_real_data.py": 20,
    "test_warm_ranks.py": 20, "test_chosen_run_length.py": 20, "test_prefect_database.py": 20, "test_reference.py": 15,
    "test_cpu_linear.py": 15, "test_warm_commands.py": 10, "test_trainer_slots.py": 10, "test_delta_checkpoints.py": 10,
}  # fmt: skip
# Modules that spend much of their time waiting with the cores idle (their test process was 55–75 %
# busy, Slurm's less): Slurm's detection of a lost node and its holds, servers starting, a
# tracking server's outage, `dlrm` commands and a study's workers that start and end. With three
# test processes they run in the last one (tests/waiting_apart.py), beside two that compute. With
# two, the longest of them starts beside the longest module that computes: two waiting ones side
# by side at the start left the cores 11 % idle over the first minutes.
WAITING_MODULES = frozenset({"test_on_slurm.py", "test_production_stack.py", "test_tracking_outage.py", "test_cli.py",
                             "test_tuning_study.py"})  # fmt: skip


def module_order(names: set[str]) -> dict[str, int]:
    """Each module's place: the longest first, the first two not both waiting ones."""
    order = sorted(names, key=lambda name: (-MODULE_SECONDS.get(name, 0), name))
    if len(order) > 2 and order[0] in WAITING_MODULES and order[1] in WAITING_MODULES:
        computing = next((name for name in order[2:] if name not in WAITING_MODULES), None)
        if computing is not None:
            order.remove(computing)
            order.insert(1, computing)
    return {name: place for place, name in enumerate(order)}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> WaitingModulesApart | None:
    """Module by module with three test processes or more: the waiting modules in the last
    (tests/waiting_apart.py). Otherwise xdist's own scheduling."""
    return scheduler_for(config, WAITING_MODULES, log)


def pytest_configure(config: pytest.Config) -> None:
    """The test modules' imports (collection) with the collector paused, as a command's start
    (training/launch/interpreter.py)."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the collection imported is left out of the collector's passes for the rest of the
    run: a full pass over it took about 0.3 s, and a test process ran one every few seconds."""
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Handed back to the collector for its last pass (see training/launch/interpreter.py)."""
    gc.unfreeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in `module_order`; within a module, the order as written (the sort is stable)."""
    place = module_order({item.path.name for item in items})
    items.sort(key=lambda item: place[item.path.name])
