from pathlib import Path

import pytest

from flows.config import ConfigError, load_config
from flows.sources import raw_sources

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
