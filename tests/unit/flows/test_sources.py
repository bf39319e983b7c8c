from pathlib import Path

import pytest

from flows.run.config import ConfigError, load_config
from flows.run.sources import raw_sources

ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, files: list[str], train="[0, 1]", evaluate="[2]"):
    path = tmp_path / "files.toml"
    quoted = ", ".join(f'"{f}"' for f in files)
    path.write_text(
        f'run_dir = "{tmp_path}"\n[data]\nsource = "files"\nfiles = [{quoted}]\n'
        f"train_days = {train}\neval_days = {evaluate}\n"
    )
    return load_config(path)


def test_criteo_1tb_names_give_the_day(tmp_path: Path) -> None:
    for day in (2, 0, 1):
        (tmp_path / f"day_{day}.gz").write_bytes(b"")
    config = _config(tmp_path, [str(tmp_path / f"day_{d}.gz") for d in (2, 0, 1)])
    sources = raw_sources(config)
    assert {day: [Path(p).name for p in files] for day, files in sources.items()} == {
        0: ["day_0.gz"], 1: ["day_1.gz"], 2: ["day_2.gz"]
    }


def test_unnamed_files_take_their_position(tmp_path: Path) -> None:
    for name in ("train.txt", "more.txt"):
        (tmp_path / name).write_bytes(b"")
    config = _config(tmp_path, [str(tmp_path / "train.txt"), str(tmp_path / "more.txt")], train="[0]", evaluate="[1]")
    assert {d: Path(f[0]).name for d, f in raw_sources(config).items()} == {0: "train.txt", 1: "more.txt"}


def test_missing_file_or_day_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.files\[0\]: .*day_0.gz does not exist"):
        raw_sources(_config(tmp_path, [str(tmp_path / "day_0.gz")]))
    (tmp_path / "day_0.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no file for day\(s\) \[1, 2\]"):
        raw_sources(_config(tmp_path, [str(tmp_path / "day_0.gz")]))


def test_synthetic_days_live_in_the_raw_dir(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs" / "tiny.toml", [f'run_dir="{tmp_path}"'])
    assert raw_sources(config) == {d: [str(tmp_path / "raw" / f"day_{d}.tsv.gz")] for d in (0, 1, 2)}


def _marked_config(tmp_path: Path, files: list[str], marker: str = "", delay: int = 0):
    path = tmp_path / "recurring.toml"
    quoted = ", ".join(f'"{f}"' for f in files)
    path.write_text(f'run_dir = "{tmp_path}"\n[data]\nsource = "files"\nfiles = [{quoted}]\n'
                    f'complete_marker = "{marker}"\ncomplete_delay_days = {delay}\n')  # fmt: skip
    return load_config(path)


def test_a_pattern_sees_the_days_that_land_later(tmp_path: Path) -> None:
    from flows.run.sources import complete_days

    logs = tmp_path / "logs"
    logs.mkdir()
    for day in (0, 1, 2):
        (logs / f"day_{day}.gz").write_bytes(b"")
    config = _marked_config(tmp_path, [f"{logs}/day_*.gz"])
    assert complete_days(config) == [0, 1, 2]
    (logs / "day_3.gz").write_bytes(b"")  # a new night's file
    assert complete_days(config) == [0, 1, 2, 3]
    assert complete_days(_marked_config(tmp_path, [f"{logs}/day_*.gz"], delay=1)) == [0, 1, 2], "newest held back"
    with pytest.raises(ConfigError, match=r"data.files\[0\]: the pattern .* matches no file"):
        complete_days(_marked_config(tmp_path, [f"{tmp_path}/none/day_*.gz"]))


def test_only_marked_days_are_complete(tmp_path: Path) -> None:
    """Per-file markers ("{file}.done") and a `_SUCCESS` per day folder."""
    from flows.run.sources import complete_days, resolve_as_of

    flat = tmp_path / "flat"
    flat.mkdir()
    for day in (0, 1, 2, 3):
        (flat / f"day_{day}.gz").write_bytes(b"")
    for day in (0, 1, 2):
        (flat / f"day_{day}.gz.done").write_bytes(b"")
    config = _marked_config(tmp_path, [f"{flat}/day_*.gz"], marker="{file}.done")
    assert complete_days(config) == [0, 1, 2] and resolve_as_of(config, "newest") == 2
    folders = tmp_path / "folders"
    for day in (0, 1, 2):
        (folders / f"day_{day}").mkdir(parents=True)
        (folders / f"day_{day}" / "part-0.gz").write_bytes(b"")
        (folders / f"day_{day}" / "part-1.gz").write_bytes(b"")
    (folders / "day_0" / "_SUCCESS").write_bytes(b"")
    config = _marked_config(tmp_path, [f"{folders}/day_*/part-*.gz"], marker="_SUCCESS")
    assert complete_days(config) == [0]
    assert [Path(p).name for p in raw_sources(config)[0]] == ["part-0.gz", "part-1.gz"], "day from the folder"
    with pytest.raises(ConfigError, match="--as-of: 'yesterday' is not a day"):
        resolve_as_of(config, "yesterday")
