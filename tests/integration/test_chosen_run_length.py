"""`training.epochs = "auto"` on the tiny config's generated days, 0–3 to train and 4 to
judge, both ways of holding rows out:

- `training.validation_rows = "newest_day"`: day 3 chooses the length and is scored by a
  model that never trained on it; a calibrator worth serving is fitted on those scores and
  served with that model, and where none is, the kept model trains a pass over day 3;
- the default, a hash slice of every day, with no calibrator (`evaluation.calibration =
  "none"`) and a calibrator's window of the newest two days: the held-out rows of all four
  days choose the length, then the kept model trains a pass over them.

The single-day case is tests/integration/test_small_real_data.py.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from training.job import CALIBRATION_PART, JobFolder

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
# checkpoints every 20 steps: some lie past the kept epoch, and must neither be resumed
# from nor crowd out the final one
AUTO = ['training.epochs="auto"', "training.max_epochs=3", "training.patience=1", "data.train_days=[0, 1, 2, 3]",
        "data.eval_days=[4]", "training.checkpoint_every=20", "training.keep_checkpoints=1"]  # fmt: skip


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str):
    from flows.deployments.pipeline import run_pipeline

    settings = [f'run_dir="{tmp_path_factory.mktemp(name)}"', *AUTO, *overrides]
    return load_config(CONFIG, settings), run_pipeline(str(CONFIG), settings)


@pytest.fixture(scope="module")
def newest_day(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    return _run(tmp_path_factory, "newest-day", 'training.validation_rows="newest_day"')


@pytest.fixture(scope="module")
def uncalibrated(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    """No calibrator: the held-out rows must train the served model."""
    return _run(tmp_path_factory, "uncalibrated", 'evaluation.calibration="none"', "evaluation.calibration_days=2")


def _ne(labels: np.ndarray, predictions: np.ndarray) -> float:
    """Normalized entropy in float64, independent of evaluation/metrics.py."""
    y, p = labels.astype(np.float64), np.clip(predictions.astype(np.float64), 1e-7, 1 - 1e-7)
    rate = y.mean()
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)) / -(rate * np.log(rate) + (1 - rate) * np.log1p(-rate)))


def _day_rows(config, days: range) -> int:
    return sum(pq.read_table(list(config.path("features").glob(f"*/day={d}/*.parquet"))).num_rows for d in days)


def _job_summary(config) -> dict:
    return json.loads(JobFolder(config.path("train")).summary_file.read_text())


@pytest.mark.parametrize("run", ["newest_day", "uncalibrated"])
def test_the_held_out_rows_choose_the_length_on_a_model_that_never_trained_on_them(run: str, request) -> None:
    """The calibration part's scores are the kept first model's. With the newest day held
    out, their NE (numpy) is the validation NE the loop measured for the kept epoch; with
    the hash slice, the loop scored every day's held-out rows (about 10 % of all four days),
    of which the calibrator's are the newest two days'."""
    config, summary = request.getfixturevalue(run)
    job, folder = _job_summary(config), JobFolder(config.path("train"))
    kept, trained = summary["epochs_kept"], summary["epochs_trained"]
    scores = {int(e): ne for e, ne in job["validation_ne"].items()}
    assert 1 <= kept <= trained == max(scores) and scores[kept] == min(scores.values())
    assert trained == config.training.max_epochs or trained - kept == config.training.patience
    held_out = folder.read_predictions(CALIBRATION_PART)
    assert len(held_out.labels) == summary["calibration_rows"]
    if run == "newest_day":
        assert summary["calibration_rows"] == job["validation_rows"] == _day_rows(config, range(3, 4))
        assert _ne(held_out.labels, held_out.predictions) == pytest.approx(scores[kept], rel=1e-4)
    else:
        assert 0.05 < job["validation_rows"] / _day_rows(config, range(4)) < 0.15, "the 10 % hash slice of every day"
        assert 0.05 < summary["calibration_rows"] / _day_rows(config, range(2, 4)) < 0.15, "of which days 2–3's"
    assert f"kept epoch {kept}'s model" in summary["run_length"]
    final = Path(job["checkpoint"])
    # after a pass over the held-out rows, the served checkpoint is that pass's (its own steps)
    last_pass = -(-job["validation_rows"] // job["global_batch_size"]) if job["refit"] else 0
    assert (final / "meta.json").is_file() and ("refit" in final.parts) == job["refit"]
    assert json.loads((final / "meta.json").read_text())["position"]["step"] == (last_pass or job["steps"])
    if not job["refit"]:
        assert [p.name for p in final.parent.glob("step-*")] == [final.name], "nothing past the kept epoch is left"


def test_without_a_calibrator_the_kept_model_trains_a_pass_over_the_held_out_rows(uncalibrated) -> None:
    """Every row trains the served model: the kept epochs over the rest, then one pass over
    every day's held-out rows (not only the calibrator's newest days'), continuing the kept
    model."""
    config, summary = uncalibrated
    kept, every_row, held_out = summary["epochs_kept"], _day_rows(config, range(4)), _job_summary(config)["validation_rows"]
    assert held_out > summary["calibration_rows"], "the older days' held-out rows are trained too"
    assert _job_summary(config)["refit"] and summary["calibrator"] == "none"
    assert summary["rows_trained"] == kept * (every_row - held_out) + held_out
    batch = summary["global_batch_size"]
    assert summary["steps"] == kept * -(-(every_row - held_out) // batch) + -(-held_out // batch)
    assert "the kept model trained one more pass, over the held-out rows that chose it" in summary["run_length"]


def test_a_kept_calibrator_serves_the_model_its_rows_scored(newest_day) -> None:
    """Whichever way the rule went, the served pair is consistent: a kept calibrator comes with
    the model that scored its rows (trained on days 0–2 only); none kept, with that model
    after a pass over day 3."""
    config, summary = newest_day
    refit = _job_summary(config)["refit"]
    calibrator = json.loads(JobFolder(config.path("train")).calibrator_file.read_text())
    assert refit == (calibrator["method"] == "none"), (refit, calibrator)
    newest = _day_rows(config, range(3, 4)) if refit else 0
    assert summary["rows_trained"] == summary["epochs_kept"] * _day_rows(config, range(3)) + newest


def test_mlflow_has_the_validation_ne_by_epoch(newest_day) -> None:
    config, summary = newest_day
    client = MlflowClient(tracking_uri=config.tracking_uri)
    history = client.get_metric_history(summary["mlflow_run_id"], "validation_ne")
    scores = _job_summary(config)["validation_ne"]
    assert sorted((m.step, round(m.value, 6)) for m in history) == sorted((int(e), round(v, 6)) for e, v in scores.items())
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    assert (metrics["epochs_kept"], metrics["epochs_trained"]) == (summary["epochs_kept"], summary["epochs_trained"])
