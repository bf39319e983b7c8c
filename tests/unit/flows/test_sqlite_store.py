"""A new SQLite tracking store copied from the migrated template (flows/tracking/sqlite_store.py)
is the store MLflow would have made: the same schema and revision, the Default experiment
where MLflow puts it; concurrent creators end with one usable store; nothing else is touched."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.tracking.runs import tracking_client
from flows.tracking.sqlite_store import ready, sqlite_path, template_store


@pytest.fixture(scope="module")
def _module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _own_cache(_module_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's template, built by its first test (the user's cache is left alone)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(_module_cache))


def _schema(path: Path) -> tuple[set[tuple[str, str, frozenset[str]]], list[tuple]]:
    """Each table's and index's definition, and the schema's revision. A definition is the set
    of its lines: MLflow's own migrations write a table's constraints in an order that changes
    from one new store to the next (seen on `runs`, in one process)."""
    with sqlite3.connect(path) as database:
        objects = {(kind, name, frozenset(line.strip().rstrip(",").strip() for line in (sql or "").splitlines()))
                   for kind, name, sql in database.execute("SELECT type, name, sql FROM sqlite_master "
                                                            "WHERE name NOT LIKE 'sqlite_%'")}  # fmt: skip
        return objects, database.execute("SELECT version_num FROM alembic_version").fetchall()


@pytest.mark.slow  # over 5 s (two stores migrated): left out of `make test-fast`
def test_a_store_from_the_template_is_the_store_mlflow_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where MLflow puts the Default experiment's artifacts: ./mlruns
    own, copied = tmp_path / "own" / "mlflow.db", tmp_path / "copied" / "mlflow.db"
    own.parent.mkdir()
    mlflow_made = MlflowClient(tracking_uri=f"sqlite:///{own}")
    mlflow_made.search_experiments()  # MLflow makes its store on first use
    copy_made = tracking_client(f"sqlite:///{copied}")
    copy_made.search_experiments()
    assert template_store() is not None and copied.is_file()
    (copied_objects, copied_revision), (own_objects, own_revision) = _schema(copied), _schema(own)
    assert copied_revision == own_revision
    assert len(copied_objects) > 100 and copied_objects == own_objects, copied_objects ^ own_objects
    default = copy_made.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == mlflow_made.get_experiment("0").artifact_location
    experiment = copy_made.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    assert experiment == "1" == mlflow_made.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    run = copy_made.create_run(experiment)
    copy_made.log_metric(run.info.run_id, "ne", 0.8)
    copy_made.create_registered_model("m")
    assert copy_made.get_run(run.info.run_id).data.metrics == {"ne": 0.8}
    assert [m.name for m in copy_made.search_registered_models()] == ["m"]


def test_concurrent_creators_end_with_one_store_that_keeps_what_each_wrote(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    template_store()  # built once, then every thread copies at the same moment
    start, errors = threading.Barrier(4), []

    def create(name: str) -> None:
        try:
            start.wait()
            tracking_client(uri).create_experiment(name)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=create, args=(f"e{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    names = {e.name for e in MlflowClient(tracking_uri=uri).search_experiments()}
    assert names == {"Default", "e0", "e1", "e2", "e3"}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["mlflow.db"], "no partial copy left"


def test_an_existing_store_and_other_stores_are_left_to_mlflow(tmp_path: Path) -> None:
    existing = tmp_path / "mlflow.db"
    existing.write_bytes(b"not touched")
    assert ready(f"sqlite:///{existing}") == f"sqlite:///{existing}" and existing.read_bytes() == b"not touched"
    for uri in ("http://127.0.0.1:5000", "postgresql://postgres@127.0.0.1/mlflow", "sqlite:///:memory:", "file:///tmp/x"):
        assert ready(uri) == uri and sqlite_path(uri) is None
    assert sqlite_path("sqlite:///runs/tiny/mlflow.db") == Path("runs/tiny/mlflow.db"), "three slashes: relative"
    assert sqlite_path("sqlite:////abs/mlflow.db?timeout=5") == Path("/abs/mlflow.db")
    assert list(tmp_path.iterdir()) == [existing], "no template is built for a store that exists"


def test_without_a_writable_cache_mlflow_makes_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # a file where the cache folder would be: no template
    store = tmp_path / "run" / "mlflow.db"
    store.parent.mkdir()
    assert template_store() is None
    assert tracking_client(f"sqlite:///{store}").get_experiment("0").name == "Default"


def test_the_look_ups_of_a_store_not_made_yet_copy_the_template_mocked_migrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port workflow's look-up of a key's newest run and `dlrm export-delta` can be the
    first to open a run's store: they make it from the template, never by MLflow's migrations
    (mocked to fail here: a second and more of CPU each)."""
    from mlflow.store.db import utils

    from flows.run.config import ConfigError, load_config
    from flows.tracking.model_delta import export_version_delta
    from flows.tracking.runs import newest_run_of_key

    template_store()  # built before the migrations are refused

    def refused(engine) -> None:
        raise AssertionError(f"migrated a new store: {engine.url}")

    monkeypatch.setattr(utils, "_initialize_tables", refused)
    store = tmp_path / "port" / "mlflow.db"
    assert newest_run_of_key(f"sqlite:///{store}", "dlrm-ctr", "fingerprint") is None and store.exists()
    config = load_config(str(Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"),
                         [f'run_dir="{tmp_path / "delta"}"'])  # fmt: skip
    with pytest.raises(ConfigError, match="version 1 of .* is not in the registry"):
        export_version_delta(config, "1", "2", tmp_path / "out")
    assert sqlite_path(config.tracking_uri).exists()
