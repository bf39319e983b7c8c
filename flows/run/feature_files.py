"""The feature files of a run's days and their preprocessing state: what the data stages
hand training (`Features`), and what an earlier run left in a run folder
(`prepared_features`, for `dlrm train`), and the tables a plan needs. Light to import: a command checks its input here
before it loads Prefect or torch."""

from __future__ import annotations

from dataclasses import dataclass

from flows.run.config import ConfigError, PipelineConfig
from flows.run.reports import IngestDay
from ingestion.preprocess import PreprocessState, features_dir, state_id_for


@dataclass(frozen=True)
class Features:
    state: PreprocessState
    files: dict[int, list[str]]  # day → feature files
    ingest: list[IngestDay]  # one report per day (none: prepared by an earlier run)

    def train_files(self, days: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(f for day in days for f in self.files[day])


def prepared_features(config: PipelineConfig) -> Features:
    """The fitted state and feature files of the config's days, as an earlier `dlrm run` or
    `dlrm preprocess` left them in the (shared) run folder."""
    warehouse, root = config.path(config.data.warehouse_dir), config.path(config.preprocess.features_dir)
    again = "run `dlrm preprocess --config …` (or `dlrm run`) with this config on the shared run folder first"
    days = config.data.shown_days(config.data.train_days)
    try:
        state_id = state_id_for(config.preprocess, warehouse, config.data.train_days)
    except (OSError, ValueError) as error:
        raise ConfigError(f"no warehouse for the training days under {warehouse} ({error}): {again}") from None
    state_path = root / state_id / "state.json"
    if not state_path.is_file():
        raise ConfigError(f"no preprocessing state {state_id} for days {days} in {root}: {again}")
    state = PreprocessState.load(state_path)
    files = {}
    for day in config.data.all_days:
        folder = features_dir(root, state, day)
        if not (folder / "_done.json").is_file():
            raise ConfigError(f"no features of day {config.data.shown(day)} in {folder}: {again}")
        files[day] = [str(path) for path in sorted(folder.glob("*.parquet"))]
    return Features(state, files, [])


@dataclass(frozen=True)
class TablesToPlan:
    """The tables `dlrm plan` plans: their rows, and how ids become rows in them (the fitted
    state's `categorical_mode`, which training reads too; the config's for declared tables)."""

    sizes: dict[str, int]
    categorical_mode: str


def tables_to_plan(config: PipelineConfig) -> TablesToPlan:
    """Declared tables if the config declares them, else the run's fitted preprocessing state."""
    declared = config.model.declared_tables.table_sizes()
    if declared:
        return TablesToPlan(declared, config.preprocess.categorical_mode)
    states = sorted(config.path(config.preprocess.features_dir).glob("*/state.json"), key=lambda p: p.stat().st_mtime)
    if not states:
        raise ConfigError(
            "model.declared_tables: no tables to plan; declare them in the config or run the pipeline first"
        )
    state = PreprocessState.load(states[-1])
    return TablesToPlan(state.table_sizes, state.mode)
