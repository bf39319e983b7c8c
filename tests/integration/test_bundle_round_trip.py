"""The offline bundle end to end, for this host (CPU build): `make bundle`'s script fetches
and packs the real wheels, `install-bundle.py` installs them into a new venv that has only
a torch (this project's, linked in), and the GPU check's CPU subset runs from there.

Left uncompressed here (`--level none`: the packing is the same, xz only makes smaller parts;
tests/unit/infra/test_bundle.py checks that an xz bundle unpacks to the same wheels): xz
took 19 of the test's 64 CPU seconds at level 0."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]
ROOT = Path(__file__).resolve().parents[2]


def _closure(name: str) -> set[str]:
    """`name` and the distributions it requires, recursively (extras left out)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if current in seen:
            continue
        try:
            dist = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(current)
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                todo.append(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])
    return seen


def _torch_only_venv(path: Path) -> Path:
    """A new venv whose only packages are torch and what torch requires (linked from this
    environment: a host that has its own torch)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    torch_site = path / "torch-site"
    torch_site.mkdir()
    for name in _closure("torch"):
        dist = importlib.metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {file.parts[0] for file in dist.files or [] if not file.parts[0].startswith("..")}:
            if (base / top).exists() and not (torch_site / top).exists():
                (torch_site / top).symlink_to(base / top)
    (site / "host-torch.pth").write_text(f"{torch_site}\n")
    return python


def test_a_cpu_bundle_installs_into_a_torch_only_venv_and_the_check_runs_from_it(tmp_path: Path) -> None:
    python = _torch_only_venv(tmp_path / "env")
    probe = "import torch, importlib.util as u; print(u.find_spec('torchrec') is None and u.find_spec('duckdb') is None)"
    has_only_torch = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert has_only_torch.stdout.strip() == "True"

    bundle = tmp_path / "bundle"
    built = subprocess.run([sys.executable, str(ROOT / "infra" / "bundle.py"), "--out", str(bundle), "--build", "cpu",
                            "--part-mb", "20", "--level", "none"], capture_output=True, text=True, timeout=900,
                           check=False)  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["target"]["build"] == "cpu" and manifest["compression"] == "none" and len(manifest["parts"]) >= 2
    assert all(part["size"] <= 20 * 2**20 for part in manifest["parts"])
    assert any(w["name"].startswith("fbgemm_gpu_cpu-") for w in manifest["wheels"])
    assert any(w["name"].startswith("dlrm_pipeline-") for w in manifest["wheels"])

    installed = subprocess.run([str(python), str(bundle / "install-bundle.py"), str(bundle), "--into",
                                str(tmp_path / "env")], capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    line = next(line for line in installed.stdout.splitlines() if line.startswith("installed "))
    chosen = set(line.split(": ", 1)[1].split(", "))
    kept = {re.sub(r"[-_.]+", "-", w["name"].split("-")[0]).lower() for w in manifest["wheels"]} - {
        re.sub(r"[-_.]+", "-", name.split("-")[0]).lower() for name in chosen}
    assert kept <= _closure("torch"), f"only what the venv had (torch's own) is kept: {kept}"
    assert f"of {len(manifest['wheels'])} wheels" in line and "torchrec-" in line and "fbgemm_gpu_cpu-" in line
    assert "torchrec" in installed.stdout.splitlines()[-1], "the training path imports"

    out = tmp_path / "check"
    checked = subprocess.run([str(python), str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), "--only",
                              "imports,plan"], capture_output=True, text=True, timeout=600, check=False,
                             cwd=tmp_path)  # fmt: skip
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["mode"].startswith("cpu subset") and results["torchrec"] and results["fbgemm"]
    assert results["checks"]["imports"]["ok"] and results["checks"]["plan"]["ok"]
