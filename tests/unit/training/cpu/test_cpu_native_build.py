"""Compiling and caching this project's C kernels (training/cpu/native_build.py), for real with
the machine's C compiler."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.cpu import native_build


@pytest.fixture
def sources(monkeypatch, tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    monkeypatch.setattr(native_build, "SOURCES", folder)
    monkeypatch.setenv("DLRM_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    native_build.load.cache_clear()
    yield folder
    native_build.load.cache_clear()


def test_a_kernel_is_compiled_once_and_rebuilt_when_its_source_changes(sources: Path, tmp_path: Path) -> None:
    (sources / "twice.c").write_text("long twice(long x) { return 2 * x; }\n")
    assert native_build.load("twice").twice(21) == 42
    built = list((tmp_path / "cache").glob("twice-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native_build.load.cache_clear()
    native_build.load("twice")
    assert built[0].stat().st_mtime_ns == stamp, "the cached library is reused"
    (sources / "twice.c").write_text("long twice(long x) { return x + x + 1; }\n")
    native_build.load.cache_clear()
    assert native_build.load("twice").twice(21) == 43
    assert len(list((tmp_path / "cache").glob("twice-*.so"))) == 2
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith("twice-")], "no staged files left"


def test_a_kernel_that_does_not_compile_names_the_compilers_error(sources: Path, tmp_path: Path) -> None:
    (sources / "broken.c").write_text("int broken(void) { return undeclared_name; }\n")
    with pytest.raises(native_build.NativeUnavailable, match="could not compile broken.c: .*undeclared"):
        native_build.load("broken")
    assert not any((tmp_path / "cache").iterdir()), "nothing half-built is left in the cache"


def test_no_compiler_is_a_clear_error(sources: Path, monkeypatch, tmp_path: Path) -> None:
    (sources / "twice.c").write_text("long twice(long x) { return 2 * x; }\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native_build.NativeUnavailable, match="no C compiler"):
        native_build.load("twice")


def test_extra_flags_build_a_library_of_their_own(sources: Path, tmp_path: Path) -> None:
    (sources / "scaled.c").write_text("#ifndef FACTOR\n#define FACTOR 2\n#endif\nlong scaled(long x) { return FACTOR * x; }\n")
    assert native_build.load("scaled").scaled(21) == 42
    assert native_build.load("scaled", ("-DFACTOR=3",)).scaled(21) == 63
    assert len(list((tmp_path / "cache").glob("scaled-*.so"))) == 2, "the flags are part of the cache key"
