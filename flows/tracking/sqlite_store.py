"""A new SQLite tracking store, copied from an empty one that MLflow migrated once.

MLflow creates a SQLite store by running every schema migration in its history: 1.3 s of
CPU for each new run folder (2.2 s in a process that has not done it before). Every `dlrm
run` in a new folder pays that. Copying an empty store that the same MLflow version
migrated takes 0.05 s, and it is the same store: MLflow's own schema at the same revision.
The template has no Default experiment, so MLflow adds it when it opens the copy, with the
artifact location it would have given it there. The template is kept in the user's cache
folder (`~/.cache/dlrm-pipeline/mlflow`), one per MLflow version and set of migrations."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from training.user_cache import copy_if_missing, migrations_digest, user_cache

log = logging.getLogger(__name__)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI (three slashes: relative to the working
    folder; four: absolute), else None."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    database = uri[len(prefix) :].split("?", 1)[0]
    return Path(database) if database and database != ":memory:" else None


def ready(uri: str) -> str:
    """`uri`, with its SQLite database created from the template if there is none yet. Any
    other store, an existing database, or a template that cannot be made: left to MLflow."""
    path = sqlite_path(uri)
    if path is None or path.exists():
        return uri
    template = template_store()
    if template is None:
        return uri
    try:
        copy_if_missing(template, path)  # a concurrent creator's copy may win: the same empty store
    except OSError as error:  # a file system without hard links: MLflow migrates a new file itself
        log.debug("the tracking store %s is created by MLflow (%s)", path, error)
    return uri


def template_store() -> Path | None:
    """This MLflow version's empty, migrated SQLite store (made on first use); None when the
    cache folder cannot hold it."""
    try:
        digest = migrations_digest(Path(mlflow.__file__).parent / "store" / "db_migrations" / "versions")
        template = user_cache() / "mlflow" / f"mlflow-{mlflow.__version__}-{digest}-empty.db"
    except RuntimeError:  # no home folder to keep it in
        return None
    if template.exists():
        return template
    building = template.with_name(f".{template.name}.{os.getpid()}-{threading.get_ident()}.building")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=f"sqlite:///{building.resolve()}")
        client.search_experiments(max_results=1)  # the tracking store: every migration, and the Default experiment
        client.search_registered_models(max_results=1)  # the registry's store on the same file
        with sqlite3.connect(building) as database:
            database.execute("DELETE FROM experiments WHERE experiment_id = 0")  # MLflow adds it where a copy opens
        os.replace(building, template)
    except (OSError, sqlite3.Error, MlflowException) as error:
        log.debug("no template tracking store in %s (%s)", template.parent, error)
        return None
    finally:
        with contextlib.suppress(OSError):
            building.unlink(missing_ok=True)
    return template
