"""The offline bundle's round trip on small wheels: packed, split into parts with their sums,
checked and installed by the standard-library installer into a new venv; a corrupt, a
short and a missing part are each named in one line; a bundle left uncompressed (`--level
none`) unpacks to the same wheels."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
INSTALLER = ROOT / "infra" / "install-bundle.py"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bundle = _module("infra_bundle", ROOT / "infra" / "bundle.py")


def _wheel(folder: Path, name: str, payload: bytes) -> Path:
    """A minimal pure-Python wheel: a package with a version and a data file."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": b'__version__ = "1.0"\n',
        f"{name}/payload.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{file},,\n" for file in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zipped:
        for file, data in files.items():
            zipped.writestr(file, data)
        zipped.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, bytes]:
    """Two wheels, one of 2.5 MiB of random bytes (incompressible), in parts of 1 MiB."""
    wheels, out = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("bundle")
    payload = os.urandom(5 * 2**19)
    _wheel(wheels, "bundled_big", payload)
    _wheel(wheels, "bundled_small", b"small")
    target = {"torch": "test", "build": "cpu", "python": PYTHON}
    manifest = bundle.assemble(wheels, out, 1, target, ["bundled_big", "bundled_small"])
    return out, manifest, payload


def _install(folder: Path, env: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(INSTALLER), str(folder), "--into", str(env)], capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def _copy(built: tuple[Path, dict, bytes], to: Path) -> Path:
    folder = built[0]
    to.mkdir()
    for file in folder.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    return to


def test_parts_are_no_larger_than_asked_and_carry_their_sums(built) -> None:
    folder, manifest, _ = built
    parts = manifest["parts"]
    assert len(parts) >= 3, "2.5 MiB of random bytes make at least three 1 MiB parts"
    assert all(part["size"] <= 2**20 for part in parts)
    for part in parts:
        data = (folder / part["name"]).read_bytes()
        assert len(data) == part["size"] and hashlib.sha256(data).hexdigest() == part["sha256"]
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert {w["name"] for w in manifest["wheels"]} == {"bundled_big-1.0-py3-none-any.whl", "bundled_small-1.0-py3-none-any.whl"}


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_the_installer_puts_the_wheels_back_into_a_new_venv(built, tmp_path: Path) -> None:
    folder, _, payload = built
    done = _install(folder, tmp_path / "env")
    assert done.returncode == 0, done.stderr
    assert "installed 2 of 2 wheels" in done.stdout and "bundled_big 1.0" in done.stdout
    python = tmp_path / "env" / "bin" / "python"
    code = ("import bundled_big, pathlib, sys; "
            "sys.stdout.buffer.write(pathlib.Path(bundled_big.__file__).with_name('payload.bin').read_bytes())")
    read = subprocess.run([str(python), "-c", code], capture_output=True, check=True, cwd=tmp_path)
    assert read.stdout == payload, "the data came back byte for byte"
    # this test's Python is a venv: the new venv sees its packages (as a GPU image's torch)
    subprocess.run([str(python), "-c", "import duckdb"], check=True, cwd=tmp_path)
    again = _install(folder, tmp_path / "env")
    assert again.returncode == 0 and "installed 0 of 2 wheels" in again.stdout, "what the venv has is kept"


@pytest.mark.parametrize("damage", ["corrupt", "short", "missing"])
def test_a_damaged_part_is_named_in_one_line(built, tmp_path: Path, damage: str) -> None:
    folder = _copy(built, tmp_path / "copy")
    second = folder / built[1]["parts"][1]["name"]
    if damage == "corrupt":
        data = bytearray(second.read_bytes())
        data[100] ^= 0xFF
        second.write_bytes(bytes(data))
    elif damage == "short":
        second.write_bytes(second.read_bytes()[:-10])
    else:
        second.unlink()
    done = _install(folder, tmp_path / "env")
    expected = {"corrupt": "is corrupt", "short": "was cut short in transfer", "missing": "is missing from"}[damage]
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("install-bundle: error: part 2 of") and expected in lines[0], lines
    assert second.name in lines[0] and not (tmp_path / "env").exists(), "nothing installed"


def test_a_bundle_for_another_python_is_refused(built, tmp_path: Path) -> None:
    folder = _copy(built, tmp_path / "copy")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["target"]["python"] = "3.99"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    done = _install(folder, tmp_path / "env")
    assert done.returncode == 2 and "this bundle is for Python 3.99" in done.stderr and "PYTHON=" in done.stderr


def _unpacked(folder: Path, manifest: dict, into: Path) -> dict[str, dict[str, bytes]]:
    """The installer's rebuilt wheels from the bundle in `folder`: each file's bytes by wheel."""
    installer = _module("install_bundle", INSTALLER)
    into.mkdir()
    wheels = installer.unpack(installer.check_parts(folder, manifest), into, manifest["compression"])
    files = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zipped:
            files[wheel.name] = {name: zipped.read(name) for name in zipped.namelist()}
    return files


def test_a_bundle_left_uncompressed_unpacks_to_the_wheels_the_compressed_one_does(built, tmp_path: Path) -> None:
    wheels, plain = tmp_path / "wheels", tmp_path / "plain"
    wheels.mkdir()
    plain.mkdir()
    _wheel(wheels, "bundled_big", built[2])
    _wheel(wheels, "bundled_small", b"small")
    manifest = bundle.assemble(wheels, plain, 1, {"torch": "test", "build": "cpu", "python": PYTHON}, [], level=None)
    assert manifest["compression"] == "none" and built[1]["compression"] == "xz"
    assert [part["name"] for part in manifest["parts"]][:2] == ["bundle.tar.001", "bundle.tar.002"]
    assert (plain / "bundle.tar.001").read_bytes()[257:262] == b"ustar", "a plain tar: its first header's magic"
    unpacked = _unpacked(plain, manifest, tmp_path / "from-plain")
    assert unpacked == _unpacked(built[0], built[1], tmp_path / "from-xz")
    assert unpacked["bundled_big-1.0-py3-none-any.whl"]["bundled_big/payload.bin"] == built[2]


def test_the_installer_reads_every_compression_the_bundle_writes() -> None:
    """The installer travels alone (standard library only), so it names the compressions itself."""
    assert set(_module("install_bundle", INSTALLER).COMPRESSIONS) == set(bundle.ARCHIVES)


def test_a_compression_the_installer_does_not_read_is_one_line(built, tmp_path: Path) -> None:
    folder = _copy(built, tmp_path / "copy")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["compression"] = "zstd"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    done = _install(folder, tmp_path / "env")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "compression 'zstd'" in lines[0] and "xz, none" in lines[0], lines
    assert not (tmp_path / "env").exists(), "nothing installed"


def test_the_level_is_xzs_or_none_and_anything_else_is_refused() -> None:
    assert bundle._level("none") is None and bundle._level("0") == 0 and bundle._level("9") == 9
    for wrong in ("10", "-1", "fast"):
        with pytest.raises(bundle.argparse.ArgumentTypeError, match="0 to 9, or none"):
            bundle._level(wrong)


def test_the_torch_range_names_a_matched_set_for_each_release() -> None:
    from training import torch_range

    assert torch_range.DEFAULT.torch == "2.13.0", "the default first"
    assert bundle.matched_set("2.11.0+cu130") == ("2.11.0", "1.6.0", "1.6.1")
    assert bundle.matched_set("2.14").torch == "2.14.1", "a minor release takes the range's patch"
    assert bundle.matched_set("2.14.1").torchrec == "1.9.2"
    with pytest.raises(bundle.BundleError, match="outside this project's range"):
        bundle.matched_set("2.9.0")
    printed = subprocess.run([sys.executable, str(ROOT / "training" / "torch_range.py"), "2.11.0"], capture_output=True,
                             text=True, check=True)  # fmt: skip
    assert printed.stdout.split() == ["2.11.0", "1.6.0", "1.6.1"], "what the Makefile reads"


def test_make_bundle_passes_its_variables_to_the_script(tmp_path: Path) -> None:
    """`make bundle`'s command line (`make -n`: printed, not run): LEVEL, HOST_HAS and PART_MB
    reach infra/bundle.py, and without them the script's defaults hold."""

    def command(*variables: str) -> list[str]:
        printed = subprocess.run(["make", "-n", "--no-print-directory", "bundle", f"OUT={tmp_path}", *variables],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
        line = printed.replace("\\\n", " ").splitlines()[-1]
        assert "infra/bundle.py" in line, printed
        return line.split()

    given = command("LEVEL=none", "HOST_HAS=numpy,pyarrow", "PART_MB=20")
    assert given[given.index("--level") + 1] == "none" and given[given.index("--part-mb") + 1] == "20"
    assert given[given.index("--host-has") + 1] == "numpy,pyarrow"
    plain = command()
    assert "--level" not in plain and "--host-has" not in plain and plain[plain.index("--part-mb") + 1] == "60"
