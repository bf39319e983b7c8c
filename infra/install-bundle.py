#!/usr/bin/env python3
"""Install a bundle made by `make bundle` on a host with no package index.

    python3 install-bundle.py DIR --into ENV

Standard library only. Checks every part named in DIR/manifest.json (its size and sha256),
reassembles and decompresses them (xz, or none where the bundle was built with `--level none`),
rebuilds each wheel, and installs with `pip --no-index`
into ENV: an existing virtual environment, or a new one made with this Python and
`--system-site-packages`, so that the host's own torch (and whatever else it has) is used.
A package the environment already has is kept as it is; fbgemm and TorchRec are installed
at the bundle's versions, which are built for its torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path

CHUNK = 4 * 2**20
MATCHED = {"fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec", "dlrm-pipeline"}  # always the bundle's own
COMPRESSIONS = ("xz", "none")  # what `make bundle` writes (the manifest's "compression")


class BundleError(RuntimeError):
    """One line saying what is wrong with the bundle or the environment, and what to do."""


def read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.is_file():
        raise BundleError(f"{path} is missing: pass the folder that `make bundle` wrote (it holds manifest.json)")
    try:
        manifest = json.loads(path.read_text())
        manifest["parts"], manifest["target"]  # both must be there
    except (ValueError, KeyError, TypeError):
        raise BundleError(f"{path} is not a bundle manifest: copy it again from where the bundle was built") from None
    compression = manifest.setdefault("compression", "xz")
    if compression not in COMPRESSIONS:
        raise BundleError(f"{path}: compression {compression!r} is not one this installer reads ({', '.join(COMPRESSIONS)}): "
                          "use the install-bundle.py that came with the bundle")  # fmt: skip
    return manifest


def check_parts(folder: Path, manifest: dict) -> list[Path]:
    """Every part present, of its size, with its sum; the first that is not is named."""
    paths = []
    for number, part in enumerate(manifest["parts"], start=1):
        path = folder / part["name"]
        where = f"part {number} of {len(manifest['parts'])} ({part['name']})"
        if not path.is_file():
            raise BundleError(f"{where} is missing from {folder}: copy it there from the bundle's folder")
        if path.stat().st_size != part["size"]:
            raise BundleError(f"{where} has {path.stat().st_size:,} bytes, not {part['size']:,}: "
                              "it was cut short in transfer; copy it again")  # fmt: skip
        digest = hashlib.sha256()
        with path.open("rb") as source:
            while chunk := source.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != part["sha256"]:
            raise BundleError(f"{where} is corrupt (its sha256 differs from manifest.json): copy it again")
        paths.append(path)
    return paths


class Concatenated:
    """The parts read back to back as one file."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = iter(paths)
        self.current = None

    def read(self, size: int = -1) -> bytes:
        while True:
            if self.current is None:
                path = next(self.paths, None)
                if path is None:
                    return b""
                self.current = path.open("rb")
            data = self.current.read(size)
            if data:
                return data
            self.current.close()
            self.current = None


def unpack(paths: list[Path], into: Path, compression: str = "xz") -> list[Path]:
    """The wheels, rebuilt from the unpacked copies in the archive (stored, not deflated:
    pip reads them as well, and it is quicker)."""
    if compression == "none":
        with tarfile.open(fileobj=Concatenated(paths), mode="r|") as tar:
            tar.extractall(into, filter="data")
    elif xz := shutil.which("xz"):  # the program is several times quicker than Python's lzma
        with subprocess.Popen([xz, "-dc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as unxz:
            feeder = threading.Thread(target=_feed, args=(Concatenated(paths), unxz.stdin), daemon=True)
            feeder.start()
            with tarfile.open(fileobj=unxz.stdout, mode="r|") as tar:
                tar.extractall(into, filter="data")
            feeder.join()
        if unxz.returncode != 0:
            raise BundleError(f"xz could not decompress the parts (status {unxz.returncode})")
    else:
        with lzma.open(Concatenated(paths)) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            tar.extractall(into, filter="data")
    wheels = []
    for unpacked in sorted(p for p in into.iterdir() if p.is_dir() and p.name.endswith(".whl")):
        wheel = into / "wheels" / unpacked.name
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zipped:
            for file in sorted(unpacked.rglob("*")):
                if file.is_file():
                    zipped.write(file, file.relative_to(unpacked).as_posix())
        wheels.append(wheel)
    return wheels


def _feed(source: Concatenated, sink) -> None:
    with sink:
        while chunk := source.read(CHUNK):
            sink.write(chunk)


def environment(path: Path) -> Path:
    """ENV's Python; a new venv that sees this Python's packages where ENV does not exist."""
    python = path / "bin" / "python"
    if python.exists():
        return python
    if path.exists() and any(path.iterdir()):
        raise BundleError(f"{path} exists and is not a virtual environment: pass a venv or a new folder")
    print(f"creating {path} (a venv that uses this Python's own packages, torch among them)", flush=True)
    made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if made.returncode != 0:
        # a Python without ensurepip: the venv without a pip of its own; this Python's pip installs into it
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)],
                       check=True)  # fmt: skip
    if sys.prefix != sys.base_prefix:
        # This Python is itself a venv (where a GPU image keeps its torch): the new venv's
        # "system" packages are the base interpreter's, so it is pointed at this venv's too.
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        (Path(purelib) / "host-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def pip_for(python: Path) -> list[str]:
    """The environment's own pip, or this Python's pip pointed at it (pip 22.3 and newer)."""
    has_pip = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, check=False).returncode == 0
    return [str(python), "-m", "pip"] if has_pip else [sys.executable, "-m", "pip", "--python", str(python)]


def installed(python: Path) -> set[str]:
    code = "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"
    listing = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return {_normal(name) for name in json.loads(listing.stdout) if name}


def _normal(name: str) -> str:
    return name.replace("_", "-").replace(".", "-").lower()


def wheel_project(wheel: Path) -> str:
    return _normal(wheel.name.split("-")[0])


def install(python: Path, wheels: list[Path]) -> list[str]:
    """pip --no-index, without dependency resolution (the bundle is the resolution): the
    wheels the environment lacks, and the matched set whatever it has."""
    present = installed(python)
    chosen = [w for w in wheels if wheel_project(w) in MATCHED or wheel_project(w) not in present]
    if chosen:
        # --no-compile: pip would compile every module of every wheel, most of which no job
        # imports; Python compiles what a job imports when it first imports it (a CPU bundle:
        # the install and the check's first run took 23 CPU seconds with pip's compile, 18 without)
        done = subprocess.run([*pip_for(python), "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--disable-pip-version-check", *map(str, chosen)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            raise BundleError(f"pip could not install the bundle: {done.stderr.strip().splitlines()[-1:]}")
    return [w.name for w in chosen]


def check_imports(python: Path, modules: list[str]) -> str:
    """Import what the manifest names in the environment; the versions of its packages."""
    probe = ("import importlib, importlib.metadata as m, json, sys\n"
             "found = {}\n"
             "for name in sys.argv[1:]:\n"
             "    module = importlib.import_module(name)\n"
             "    found[name] = getattr(module, '__version__', '')\n"
             "print(', '.join(f'{k} {v}'.strip() for k, v in found.items() if v))")  # fmt: skip
    done = subprocess.run([str(python), "-c", probe, *modules], capture_output=True, text=True, check=False,
                          cwd=tempfile.gettempdir())  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BundleError(f"installed, but the training path does not import: {last}")
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="the folder with manifest.json and the parts")
    parser.add_argument("--into", type=Path, required=True, help="a venv to install into (made if missing)")
    parser.add_argument("--keep", type=Path, help="also keep the rebuilt wheels in this folder")
    args = parser.parse_args(argv)
    try:
        manifest = read_manifest(args.bundle)
        target = manifest["target"]
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if target.get("python") != here:
            raise BundleError(f"this bundle is for Python {target.get('python')}, this is Python {here}: "
                              f"build one with `make bundle PYTHON={here}`")  # fmt: skip
        paths = check_parts(args.bundle, manifest)
        print(f"{len(paths)} parts checked; unpacking", flush=True)
        python = environment(args.into.absolute())
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as scratch:
            wheels = unpack(paths, Path(scratch), manifest["compression"])
            names = install(python, wheels)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for wheel in wheels:
                    os.replace(wheel, args.keep / wheel.name)
        print(f"installed {len(names)} of {len(wheels)} wheels into {args.into}: {', '.join(names)}", flush=True)
        print(check_imports(python, manifest.get("imports", [])), flush=True)
    except BundleError as error:
        print(f"install-bundle: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
