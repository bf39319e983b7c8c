"""A Python that has this project's dependencies but cannot import the project: where a
registered model must load "anywhere"."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path


def make_foreign_python(folder: Path) -> Path:
    """A venv whose only packages are those of this one, by a plain path (.pth) line: the
    project's editable-install hook lives in a .pth file that such a path never runs, and
    the venv's `uvicorn` (which `mlflow models serve` starts) is its own."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    (Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    uvicorn = folder / "bin" / "uvicorn"
    uvicorn.write_text(f"#!{python}\nfrom uvicorn.main import main\nmain()\n")
    uvicorn.chmod(0o755)
    return python
