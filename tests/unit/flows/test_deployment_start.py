"""A deployment's flow run loads its flow's file the way Prefect's engine does (by path, in a
new interpreter) with the collector paused for the file's imports: what they built is frozen
(left out of later passes) and collection is on again afterwards. One interpreter loads the
retune deployment's file, then the pipeline's (nightly, retrain)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow  # a new interpreter that imports the pipeline: 8 s

LOAD = """
import contextlib, gc, json, sys
import prefect.engine  # the flow run's own start, before it loads the entrypoint
from prefect.utilities.importtools import import_object
import training.launch.interpreter as interpreter

pauses = []
paused = interpreter.imports_without_collection

@contextlib.contextmanager
def counted():
    pauses.append(gc.isenabled())
    with paused():
        yield

interpreter.imports_without_collection = counted
said = []
for entrypoint in sys.argv[1:]:
    frozen_before, pauses_before = gc.get_freeze_count(), len(pauses)
    flow = import_object(entrypoint)
    said.append({"name": flow.name, "pauses": len(pauses) - pauses_before,
                 "frozen": gc.get_freeze_count() - frozen_before, "enabled": gc.isenabled()})
print(json.dumps(said))
"""


def test_a_flow_runs_entrypoint_imports_with_the_collector_paused() -> None:
    entrypoints = ["flows/tuning/retune.py:retune", "flows/deployments/pipeline.py:retrain"]
    done = subprocess.run([sys.executable, "-c", LOAD, *entrypoints], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    retune, retrain = json.loads(done.stdout.strip().splitlines()[-1])
    assert (retune["name"], retrain["name"]) == ("retune", "retrain")
    assert retune["pauses"] >= 1 and retrain["pauses"] >= 1, "each file pauses the collector for its imports"
    assert retune["enabled"] and retrain["enabled"], "collection is on again once a file is loaded"
    # torch, TorchRec, Optuna and MLflow build hundreds of thousands of objects: frozen, not walked
    assert retune["frozen"] > 100_000, retune
