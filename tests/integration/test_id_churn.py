"""Managed-collision ids end to end (`preprocess.categorical_mode = "managed"`): two nights on
days whose ids come and go train with a remapper in front of the tables, the second
continuing the first; the newest serves the same remapping where the project is not
installed, and its remapping survives checkpoints and changes of world size exactly.
(How the modes compare night after night: bench/id_churn.py, docs/managed-ids.md.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from foreign_python import champion_scores_elsewhere, raw_lines, run_predictions
from mlflow.tracking import MlflowClient

from flows.config import load_config
from training.job import JobFolder, TrainJob

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
MANAGED = ['preprocess.categorical_mode="managed"', "preprocess.managed.eviction_interval=10",
           "data.synthetic.id_lifetime_days=3"]  # fmt: skip


@pytest.fixture(scope="module")
def managed_run(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    """Nights as of days 2 and 3: the second continues the first's model and remapping."""
    from flows.pipeline import run_pipeline

    overrides = [f'run_dir="{tmp_path_factory.mktemp("managed")}"', *MANAGED]
    first = run_pipeline(TINY, overrides, "2")
    return load_config(TINY, overrides), first, run_pipeline(TINY, overrides, "3")


def test_a_night_continues_the_last_ones_remapping_and_is_judged_against_it(managed_run) -> None:
    _, first, second = managed_run
    assert first["promoted"], first["promotion_reason"]
    assert second["warm_start_version"] == first["model_version"] and second["days_trained"] == [2]
    # the champion scored day 3 through its own remapping (the served one): a real NE
    assert 0.5 < second["champion_ne_same_days"] < second["baseline_constant_ne"]
    assert second["eval_ne"] < second["baseline_constant_ne"]
    # the rounds and what they did, in the job's summary and the night's MLflow run
    config, _, _ = managed_run
    trained = JobFolder(config.path("train")).read_summary()
    assert trained.managed_rounds >= 2 and trained.managed_restarted_rows > 0 and trained.managed_resident_ids > 0
    metrics = MlflowClient(config.tracking_uri).get_run(second["mlflow_run_id"]).data.metrics
    assert metrics["managed_ids_resident"] == trained.managed_resident_ids


def test_the_served_model_remaps_raw_lines_as_the_run_did_where_the_project_is_not(managed_run, tmp_path: Path) -> None:
    config, _, second = managed_run
    lines, expected = raw_lines(config, 3), run_predictions(config, 3)
    scores = champion_scores_elsewhere(config, lines, tmp_path, version=second["model_version"])
    assert scores.shape == expected.shape == (6000,)
    assert np.abs(scores - expected).max() <= 1e-6


def _reshard(job_file: Path, checkpoint: Path, world: int, out: Path, save_to: Path | None = None) -> list[dict]:
    out.mkdir(parents=True)
    command = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", f"--nproc-per-node={world}",
               str(ROOT / "tests" / "integration" / "managed_reshard.py"), str(job_file), str(checkpoint), str(out),
               *([str(save_to)] if save_to else [])]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank-{rank}.pt") for rank in range(world)]


def test_the_remapping_survives_a_checkpoint_and_resharding_2_1_2_exactly(managed_run, tmp_path: Path) -> None:
    """The run's checkpoint (2 processes) loaded into 1 process, saved as that process's
    warm start, loaded into 2: every process holds the remapper the run ended with."""
    from training.serving.export import export_managed_ids

    config, _, _ = managed_run
    folder = JobFolder(config.path("train"))
    job = TrainJob.load(folder.job_file())
    checkpoint = Path(folder.read_summary().checkpoint)
    assert job.workers.world_size == 2
    managed = export_managed_ids(job, checkpoint)
    assert managed is not None
    resident = {feature: len(managed.id_rows(feature)) for feature in managed.tables}
    assert all(count > 0 for count in resident.values()), resident
    reference = managed.state_dict()
    on_one = _reshard(folder.job_file(), checkpoint, 1, tmp_path / "one", tmp_path / "warm-start")
    [saved] = [p for p in (tmp_path / "warm-start").iterdir() if p.name.startswith("step-")]
    on_two = _reshard(folder.job_file(), saved, 2, tmp_path / "two")
    for state in (*on_one, *on_two):
        assert state.keys() == reference.keys()
        for key, tensor in reference.items():
            assert torch.equal(state[key], tensor), key
