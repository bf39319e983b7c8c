"""Which raw files feed which day: resolved and checked before any flow starts.

`data.files` entries may be glob patterns (`/data/criteo/day_*.gz`): a recurring
installation lists the folder new days land in once, and each run sees the days there.
A Parquet source (`data.path`) is listed by its partition folders (`ds=2026-11-24/`): only
the days a run needs are opened.
"""

from __future__ import annotations

import glob
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from flows.run.config import ConfigError, PipelineConfig
from ingestion.days import DayError, parse_day
from ingestion.warehouse import day_of

GLOB_CHARACTERS = set("*?[")


def raw_sources(config: PipelineConfig) -> dict[int, list[str]]:
    """Raw files per day: the generated days, or the configured Criteo files (which must exist)."""
    if config.data.source == "synthetic":
        raw = config.path(config.data.raw_dir)
        return {day: [str(raw / f"day_{day}.tsv.gz")] for day in config.data.all_days}
    by_day = partition_files(config, config.data.all_days) if config.data.source == "parquet" else files_by_day(config)
    missing = [day for day in config.data.all_days if day not in by_day]
    if missing and config.data.source == "parquet":
        data = config.data
        present = ", ".join(f"{data.partition}={data.shown(d)}" for d in sorted(partition_files(config))[-3:]) or "none"
        raise ConfigError(f"data.path: no partition {data.partition}={data.shown(missing[0])} with Parquet "
                          f"files in {data.path} (the newest there: {present}); fix data.train_days/eval_days")  # fmt: skip
    if missing:
        raise ConfigError(f"data.files: no file for day(s) {missing}; name files day_N or list them in day order")
    return by_day


def files_by_day(config: PipelineConfig) -> dict[int, list[str]]:
    """Every configured file (patterns expanded) under its day: `day_N` in its name or its
    folder's, else its position in the expanded list. A Parquet source: its partitions' files."""
    if config.data.source == "parquet":
        return partition_files(config)
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


def partition_files(config: PipelineConfig, days: Sequence[int] | None = None) -> dict[int, list[str]]:
    """A Parquet source's days (`{partition}=VALUE` folders whose value is a day written as
    the config writes its days) → their Parquet files, in name order; with `days`, only
    those partitions are listed (a warehouse of years is not walked for a run of a week).
    Files and folders whose names start with `_` or `.` (markers, staging) are not data."""
    import fsspec

    data = config.data
    try:
        filesystem, root = fsspec.core.url_to_fs(data.path if "://" in data.path else str(config.path(data.path)))
        entries = filesystem.ls(root, detail=False)
    except (OSError, ValueError) as error:
        raise ConfigError(f"data.path: cannot list {data.path}: {error}; point it at the dataset's folder") from None
    by_day: dict[int, list[str]] = {}
    for entry in entries:
        name = entry.rstrip("/").rpartition("/")[2]
        key, _, value = name.partition("=")
        if key != data.partition or not value:
            continue
        try:
            day = parse_day(value)
        except DayError:
            continue  # e.g. __HIVE_DEFAULT_PARTITION__
        if (data.dated and value.isdigit()) or (not data.dated and not value.isdigit()):
            continue  # written another way than the config's days
        if days is not None and day not in days:
            continue
        files = sorted(f for f in filesystem.find(entry) if f.endswith(".parquet") and not _hidden(f, entry))
        if files:
            by_day[day] = [filesystem.unstrip_protocol(f) if "://" in data.path else f for f in files]
    return by_day


def _hidden(path: str, folder: str) -> bool:
    return any(part.startswith(("_", ".")) for part in path[len(folder) :].split("/") if part)


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


NEWEST = "newest"  # `--as-of newest`: the newest complete day


def resolve_as_of(config: PipelineConfig, as_of: str | int | None) -> int | None:
    """`--as-of`: a day, "newest" (the newest complete day), or None for a plain run."""
    if as_of is None or as_of == "":
        return None
    if str(as_of) == NEWEST:
        days = complete_days(config)
        if not days:
            raise ConfigError("--as-of newest: no complete day yet (data.files, data.complete_marker)")
        return days[-1]
    try:
        return parse_day(as_of)
    except DayError as error:
        raise ConfigError(f"--as-of: {error}, or 'newest'") from None
