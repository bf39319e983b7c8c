"""Which raw files feed which day: resolved and checked before any flow starts."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from flows.config import ConfigError, PipelineConfig
from ingestion.warehouse import day_of


def raw_sources(config: PipelineConfig) -> dict[int, list[str]]:
    """Raw files per day: the generated days, or the configured Criteo files (which must exist)."""
    if config.data.source == "synthetic":
        raw = config.path(config.data.raw_dir)
        return {day: [str(raw / f"day_{day}.tsv.gz")] for day in config.data.all_days}
    by_day: dict[int, list[str]] = defaultdict(list)
    for index, source in enumerate(config.data.files):
        if "://" in source:
            by_day[day_of(source, index)].append(source)
            continue
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.files[{index}]: {source} does not exist; fix the path or remove it")
        by_day[day_of(source, index)].append(str(path.resolve()))
    missing = [day for day in config.data.all_days if day not in by_day]
    if missing:
        raise ConfigError(f"data.files: no file for day(s) {missing}; name files day_N or list them in day order")
    return dict(by_day)
