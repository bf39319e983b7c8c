"""`make bundle`: everything the training path needs, for a host with its own torch and no
package index, as compressed parts of at most PART_MB MiB with a manifest of their sums.

    python infra/bundle.py --out DIR [--torch 2.11.0] [--build cuda|cpu] [--python 3.12]
                           [--part-mb 60] [--host-has numpy,pyarrow] [--level 0-9|none]

The wheels (fbgemm and TorchRec matched to the torch, requirements/training.txt, and this
project) are fetched for the target's Python and platform, unpacked, and written as one tar
compressed with xz: a GPU host's Python reads xz with its standard library, and unpacked
wheels compress far better than the wheels themselves (fbgemm-gpu 1.6.0: a 465 MB wheel,
2.4 GB unpacked; docs/gpu.md has the figures). `--level none` leaves the tar as it is: the
quickest build, for a host the parts reach quickly whatever their size.
`infra/install-bundle.py` puts it back together on the host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from training import torch_range
from training.torch_range import MatchedSet

REQUIREMENTS = ROOT / "requirements"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MIB = 2**20
# The archive's name by compression (the manifest's "compression"); its parts add .001, .002, …
ARCHIVES = {"xz": "bundle.tar.xz", "none": "bundle.tar"}
# what the installer imports to call an installation good
TRAINING_IMPORTS = ["torch", "fbgemm_gpu", "torchrec", "duckdb", "pyarrow", "tensordict", "training.loop.batches"]


class BundleError(RuntimeError):
    """A bundle that cannot be built as asked: one line that says what to change."""


def matched_set(torch_version: str) -> MatchedSet:
    try:
        return torch_range.matched_set(torch_version)
    except torch_range.OutsideTheRange as error:
        raise BundleError(f"{error}: pass --torch with one of them") from None


def pinned(names: list[str]) -> list[str]:
    """Each name at its version in requirements/constraints.txt (or unpinned)."""
    versions = {}
    for line in (REQUIREMENTS / "constraints.txt").read_text().splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            versions[_normal(name)] = version.strip()
    return [f"{name}=={versions[_normal(name)]}" if _normal(name) in versions else name for name in names]


def training_requirements(host_has: set[str]) -> list[str]:
    names = [line.strip() for line in (REQUIREMENTS / "training.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]  # fmt: skip
    return pinned([name for name in names if _normal(name) not in host_has])


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(requirements: list[str], python: str, into: Path) -> None:
    """Wheels for `python` on x86-64 Linux, without their dependencies (the list is complete:
    torch and what it brings are the host's)."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", str(into)]  # fmt: skip
    for tag in PLATFORMS:
        command += ["--platform", tag]
    done = subprocess.run(command + requirements, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        raise BundleError(f"pip could not fetch the wheels: {errors[-1] if errors else done.stderr[-300:]}")


def project_wheel(into: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(into), str(ROOT)], capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise BundleError(f"could not build this project's wheel: {done.stderr.strip()[-300:]}")


def pack(wheels: Path, archive: Path, level: int | None = 9) -> list[dict]:
    """One tar of every wheel unpacked (`<wheel file name>/…`), xz-compressed at `level`: by
    the `xz` program on all cores where there is one (2.5 GB of fbgemm take ~10 minutes on 2
    cores), else by Python's lzma on one. `level` None: the tar as it is."""
    listed = []
    with archive.open("wb") as out:
        if level is None:  # the tar as it is
            compressor, sink = None, out
        elif xz := shutil.which("xz"):
            compressor = subprocess.Popen([xz, f"-{level}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
            sink = compressor.stdin
        else:
            compressor, sink = None, lzma.open(out, "wb", preset=level)  # noqa: SIM115 - closed below, after the tar
        with tarfile.open(fileobj=sink, mode="w|") as tar:
            for wheel in sorted(wheels.glob("*.whl")):
                with tempfile.TemporaryDirectory() as unpacked, zipfile.ZipFile(wheel) as zipped:
                    zipped.extractall(unpacked)
                    tar.add(unpacked, arcname=wheel.name)
                listed.append({"name": wheel.name, "size": wheel.stat().st_size})
                print(f"  packed {wheel.name} ({wheel.stat().st_size / MIB:,.1f} MiB)", flush=True)
        if sink is not out:
            sink.close()
        if compressor and compressor.wait() != 0:
            raise BundleError(f"xz failed with status {compressor.returncode}")
    return listed


def split(archive: Path, out: Path, part_mb: int) -> list[dict]:
    parts = []
    with archive.open("rb") as source:
        index = 1
        while chunk := source.read(part_mb * MIB):
            name = f"{archive.name}.{index:03d}"
            (out / name).write_bytes(chunk)
            parts.append({"name": name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            index += 1
    return parts


def build(out: Path, torch_version: str, build_kind: str, python: str, part_mb: int, host_has: set[str],
          level: int | None = 9) -> dict:  # fmt: skip
    if part_mb < 1:
        raise BundleError(f"--part-mb must be at least 1, got {part_mb}")
    matched = matched_set(torch_version)
    fbgemm = "fbgemm-gpu" if build_kind == "cuda" else "fbgemm-gpu-cpu"
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*(part for name in ARCHIVES.values() for part in out.glob(f"{name}.[0-9]*")), out / "manifest.json"]:
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        wheels = Path(scratch) / "wheels"
        wheels.mkdir()
        requirements = [f"{fbgemm}=={matched.fbgemm}", f"torchrec=={matched.torchrec}", *training_requirements(host_has)]
        print(f"fetching {len(requirements)} wheels for Python {python} ({build_kind}, torch {matched.torch})", flush=True)
        download(requirements, python, wheels)
        project_wheel(wheels)
        target = {"torch": matched.torch, "build": build_kind, "python": python, "fbgemm": f"{fbgemm}=={matched.fbgemm}",
                  "torchrec": f"torchrec=={matched.torchrec}", "platform": "linux x86_64"}  # fmt: skip
        return assemble(wheels, out, part_mb, target, TRAINING_IMPORTS, level)


def assemble(wheels: Path, out: Path, part_mb: int, target: dict, imports: list[str], level: int | None = 9) -> dict:
    """The wheels in `wheels` packed (xz at `level`; None: not compressed), split into parts of
    `part_mb` MiB in `out`, and `out/manifest.json`; returns the manifest."""
    compression = "none" if level is None else "xz"
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        archive = Path(scratch) / ARCHIVES[compression]
        listed = pack(wheels, archive, level)
        parts = split(archive, out, part_mb)
    manifest = {"target": target, "compression": compression, "imports": imports, "wheels": listed, "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _level(text: str) -> int | None:
    """`--level`: xz's 0–9, or none (None)."""
    if text == "none":
        return None
    if text.isdigit() and 0 <= int(text) <= 9:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: give xz's level, 0 to 9, or none")


def this_host() -> tuple[str, str, str]:
    """This host's torch release, build and Python: the defaults."""
    try:
        import torch

        version, kind = torch.__version__, "cuda" if torch.version.cuda else "cpu"
    except ImportError:
        version, kind = torch_range.DEFAULT.torch, "cpu"
    return version, kind, ".".join(platform.python_version_tuple()[:2])


def main(argv: list[str] | None = None) -> int:
    torch_version, kind, python = this_host()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the parts and manifest.json")
    parser.add_argument("--torch", default=torch_version, help=f"the host's torch release (default {torch_version})")
    parser.add_argument("--build", choices=("cuda", "cpu"), default=kind, help=f"fbgemm's build (default {kind})")
    parser.add_argument("--python", default=python, help=f"the host's Python, X.Y (default {python})")
    parser.add_argument("--part-mb", type=int, default=60, help="largest part in MiB (default 60)")
    parser.add_argument("--host-has", default="", help="comma-separated packages the host already has, left out")
    parser.add_argument("--level", type=_level, default=9, metavar="0-9|none",
                        help="xz's compression level (default 9: smallest parts; 0: quickest); none: not compressed")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        print(f"bundle: error: --python {args.python}: give the host's Python as X.Y, e.g. 3.12", file=sys.stderr)
        return 2
    host_has = {_normal(name) for name in args.host_has.replace(" ", ",").split(",") if name}
    try:
        manifest = build(args.out, args.torch, args.build, args.python, args.part_mb, host_has, args.level)
    except BundleError as error:
        print(f"bundle: error: {error}", file=sys.stderr)
        return 2
    total = sum(part["size"] for part in manifest["parts"])
    print(f"{len(manifest['parts'])} parts, {total / MIB:,.1f} MiB in {args.out}; on the host: "
          f"python3 install-bundle.py {args.out} --into ENV")  # fmt: skip
    shutil.copy(ROOT / "infra" / "install-bundle.py", args.out / "install-bundle.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
