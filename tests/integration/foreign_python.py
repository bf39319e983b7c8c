"""A Python that has this project's dependencies but cannot import the project: where a
registered model must load "anywhere"; and what a run predicted, to compare with it."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

from evaluation.calibration import Calibrator
from training.job import JobFolder

SCORE_LINES = """
import json, sys
import mlflow, numpy as np, pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
lines = json.load(open(sys.argv[2]))
np.save(sys.argv[3], model.predict(pd.DataFrame({"line": lines})))
"""


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


def run_predictions(config, day: int) -> np.ndarray:
    """The run's own predictions of the day as it reported them, in row order (rank r scored
    the r-th share): the model's probabilities through the run's calibrator."""
    folder = JobFolder(config.path("train"))
    calibrator = Calibrator.from_dict(json.loads((folder.serving / "model.json").read_text())["calibration"])
    assert calibrator.rows > 0, "fitted (or found of no use: then \"none\") on held-out rows"
    return calibrator.apply(folder.read_predictions(str(day)).predictions)


def raw_lines(config, day: int) -> list[str]:
    with gzip.open(config.path(config.data.raw_dir) / f"day_{day}.tsv.gz", "rt") as lines:
        return lines.read().splitlines()


def champion_scores_elsewhere(config, lines: list[str], folder: Path, version: str = "") -> np.ndarray:
    """The registered champion's (or `version`'s) scores of raw `lines`, loaded by MLflow in a
    Python that cannot import this project."""
    python = make_foreign_python(folder / "venv")
    cannot = subprocess.run([python, "-c", "import training"], cwd=folder, capture_output=True, text=True,
                            check=False)  # fmt: skip
    assert "No module named 'training'" in cannot.stderr, "the project is not importable there"
    (folder / "lines.json").write_text(json.dumps(lines))
    (folder / "score.py").write_text(SCORE_LINES)
    environment = {**os.environ, "MLFLOW_TRACKING_URI": config.tracking_uri, "PYTHONPATH": ""}
    model = f"models:/{config.tracking.registered_model}/{version}" if version else \
        f"models:/{config.tracking.registered_model}@champion"  # fmt: skip
    subprocess.run([python, "score.py", model, "lines.json", "scores.npy"], cwd=folder, env=environment, check=True,
                   timeout=300)  # fmt: skip
    return np.load(folder / "scores.npy")
