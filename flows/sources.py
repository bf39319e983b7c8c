"""Which raw files feed which day: resolved and checked before any flow starts.

`data.files` entries may be glob patterns (`/data/criteo/day_*.gz`): a recurring
installation lists the folder new days land in once, and each run sees the days there.
"""

from __future__ import annotations

import glob
from collections import defaultdict
from pathlib import Path

from flows.config import ConfigError, PipelineConfig
from ingestion.warehouse import day_of

GLOB_CHARACTERS = set("*?[")


def raw_sources(config: PipelineConfig) -> dict[int, list[str]]:
    """Raw files per day: the generated days, or the configured Criteo files (which must exist)."""
    if config.data.source == "synthetic":
        raw = config.path(config.data.raw_dir)
        return {day: [str(raw / f"day_{day}.tsv.gz")] for day in config.data.all_days}
    by_day = files_by_day(config)
    missing = [day for day in config.data.all_days if day not in by_day]
    if missing:
        raise ConfigError(f"data.files: no file for day(s) {missing}; name files day_N or list them in day order")
    return by_day


def files_by_day(config: PipelineConfig) -> dict[int, list[str]]:
    """Every configured file (patterns expanded) under its day: `day_N` in its name or its
    folder's, else its position in the expanded list."""
    by_day: dict[int, list[str]] = defaultdict(list)
    for index, (entry, source) in enumerate(_expanded(config.data.files)):
        if "://" in source:
            by_day[day_of(source, index)].append(source)
            continue
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.files[{entry}]: {source} does not exist; fix the path or remove it")
        by_day[day_of(source, index)].append(str(path.resolve()))
    return dict(by_day)


def complete_days(config: PipelineConfig) -> list[int]:
    """The days a run may take as "today" (`--as-of newest`), oldest first.

    Synthetic: the configured days (the generator has no newer ones). Files: days whose
    every file has its `data.complete_marker` beside it, less the newest
    `data.complete_delay_days` days present, which are taken as still being written.
    """
    if config.data.source == "synthetic":
        return list(config.data.all_days)
    by_day = files_by_day(config)
    present = sorted(by_day)
    held_back = set(present[len(present) - config.data.complete_delay_days :]) if config.data.complete_delay_days else set()
    marker = config.data.complete_marker
    return [day for day in present if day not in held_back and (not marker or all(_marked(f, marker) for f in by_day[day]))]


def _marked(source: str, marker: str) -> bool:
    if "://" in source:  # object stores: the marker as a sibling key
        import fsspec

        folder, _, name = source.rpartition("/")
        filesystem, path = fsspec.core.url_to_fs(f"{folder}/{marker.format(file=name)}")
        return filesystem.exists(path)
    path = Path(source)
    return (path.parent / marker.format(file=path.name)).is_file()


def _expanded(entries: tuple[str, ...]) -> list[tuple[int, str]]:
    """(index of the entry, file) for every file, patterns expanded in name order."""
    files = []
    for index, entry in enumerate(entries):
        if "://" in entry or not GLOB_CHARACTERS & set(entry):
            files.append((index, entry))
            continue
        matches = sorted(glob.glob(str(Path(entry).expanduser())))
        if not matches:
            raise ConfigError(f"data.files[{index}]: the pattern {entry} matches no file; fix it or remove it")
        files += [(index, match) for match in matches]
    return files
