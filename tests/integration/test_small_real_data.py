"""The pipeline on data like a small real Criteo sample (configs/small-real.toml): weak
signal, most ids seen once, 8,000 training rows. The references must mean what they say and
the gate must promote only a model ahead of both (tests/unit/flows/test_registry.py refuses
one behind them in a real MLflow store)."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from flows.tracking.registry import CHAMPION_ALIAS, current_champion

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "small-real.toml"


@pytest.fixture(scope="module")
def small_run(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    from flows.deployments.pipeline import run_pipeline

    overrides = [f'run_dir="{tmp_path_factory.mktemp("small-real")}"']
    return load_config(CONFIG, overrides), run_pipeline(str(CONFIG), overrides)


def test_every_training_row_is_trained_at_a_batch_that_gives_enough_steps(small_run) -> None:
    config, summary = small_run
    features = list(config.path("features").glob("*/day=0/*.parquet"))
    given = pq.read_table(features, partitioning=None).num_rows
    assert given == 8000 and 600 < summary["calibration_rows"] < 1000, "about 10 % held out for the calibrator"
    # batch 2,048 would be 4 steps an epoch; min_steps = 50 halves it to 128: 57 steps of the
    # 7,200-odd rows an epoch, for as many epochs as the validation rows chose
    # (and then one pass over the held-out rows, when no calibrator was kept and the model
    # trained on them too; a model kept at its start, the regression, trains no step)
    held_out, kept = summary["calibration_rows"], summary["epochs_kept"]
    last_pass = held_out if summary["refit"] and kept else 0
    assert summary["rows_trained"] == kept * (given - held_out) + last_pass
    steps = kept * -(-(given - held_out) // 128) + -(-last_pass // 128)
    assert (summary["global_batch_size"], summary["steps"]) == (128, steps)
    assert summary["refit"] == summary["calibrator"].startswith("none"), "the held-out rows fit or train"


def test_the_run_length_is_chosen_on_the_calibration_rows_and_the_best_epoch_is_kept(small_run) -> None:
    """`training.epochs = "auto"` (the default): the loop's validation NE of the kept epoch is
    the NE of the calibration rows' predictions written after training (numpy float64), so
    the kept model is the best one, scored on the rows its calibrator was then fitted on."""
    import json

    import numpy as np

    from training.job import CALIBRATION_PART, JobFolder
    from training.loop.validation import REGRESSION_MARGIN

    config, summary = small_run
    folder = JobFolder(config.path("train"))
    job = json.loads(folder.summary_file.read_text())
    scores = {int(e): ne for e, ne in job["validation_ne"].items()}
    kept, trained = summary["epochs_kept"], summary["epochs_trained"]
    # the wide part starts as the fitted regression: it is scored first, as epoch 0
    assert 0 <= kept <= trained == max(scores) and sorted(scores) == list(range(trained + 1))
    best = min(scores.values())
    if kept == 0:  # the start stays unless an epoch beats it by the margin
        assert best > scores[0] * (1.0 - REGRESSION_MARGIN) and "by more than 0.5%" in summary["run_length"]
    else:
        assert scores[kept] == best <= scores[0] * (1.0 - REGRESSION_MARGIN)
    assert trained == config.training.max_epochs or trained - kept == config.training.patience
    held_out = folder.read_predictions(CALIBRATION_PART)
    assert len(held_out.labels) == summary["calibration_rows"]
    labels, p = held_out.labels.astype(np.float64), np.clip(held_out.predictions.astype(np.float64), 1e-7, 1 - 1e-7)
    rate = labels.mean()
    oracle = -np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)) / -(rate * np.log(rate) + (1 - rate) * np.log1p(-rate))
    assert oracle == pytest.approx(scores[kept], rel=1e-4)
    assert (f"kept epoch {kept}'s model" if kept else "kept the model it started from") in summary["run_length"]
    history = MlflowClient(tracking_uri=config.tracking_uri).get_metric_history(summary["mlflow_run_id"], "validation_ne")
    assert sorted((m.step, round(m.value, 6)) for m in history) == sorted((e, round(v, 6)) for e, v in scores.items())


def test_a_kept_regression_start_serves_no_calibrator_and_is_fitted_again_on_every_row(small_run) -> None:
    """small-real's run keeps its start, the fitted regression (no epoch beats it by the
    margin): a regression is calibrated by its own fit, so no calibrator is fitted on the
    held-out rows; they join the fit instead, and the served probabilities stay calibrated
    (Platt on its 815 rows served 0.916)."""
    _, summary = small_run
    assert summary["epochs_kept"] == 0 and summary["steps"] == 0, summary["run_length"]
    assert summary["refit"] and summary["calibrator"].startswith("none (the served model trained on the held-out rows")
    assert "calibrated by its own fit (no calibrator is fitted)" in summary["run_length"]
    assert summary["eval_ne"] == summary["eval_ne_uncalibrated"]
    assert abs(summary["eval_calibration"] - 1.0) < 0.03, summary["eval_calibration"]


def test_the_logistic_regression_reference_beats_the_constant(small_run) -> None:
    _, summary = small_run
    assert summary["logistic_regression_ne"] < summary["baseline_constant_ne"] - 0.02


def test_a_model_ahead_of_both_references_is_promoted_as_the_first_champion(small_run) -> None:
    """The wide part starts as the regression with each feature's own L2 (`model.wide_start_l2`),
    which predicts the next day better than the reference's one C (0.9317 against 0.9326)."""
    config, summary = small_run
    ne, lr, constant = summary["eval_ne"], summary["logistic_regression_ne"], summary["baseline_constant_ne"]
    calibrated = config.evaluation.calibration_min <= summary["eval_calibration"] <= config.evaluation.calibration_max
    assert summary["promoted"] == (ne < lr and ne < constant and calibrated), "the gate's rule, whatever the NE"
    assert ne < lr < constant, f"the model ahead of the logistic regression (NE {ne:.4f} vs {lr:.4f})"
    assert summary["promoted"], summary["promotion_reason"]
    client = MlflowClient(tracking_uri=config.tracking_uri)
    name = config.tracking.registered_model
    version = client.get_model_version(name, summary["model_version"])
    assert version.tags["promotion.decision"] == "promoted"
    champion = current_champion(client, name)
    assert champion is not None and champion.version == version.version, f"the '{CHAMPION_ALIAS}' alias on it"
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["promotion.reason"] == summary["promotion_reason"]


def test_the_logistic_regression_reference_is_within_1_percent_of_scikit_learns(small_run) -> None:
    """scikit-learn's `LogisticRegression` on the same features (one column per id seen in
    training, the preprocessed dense columns), C chosen the same way on the same hashed
    slice of the training rows, refit on all, scored on the evaluation day."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    from evaluation.metrics import binary_state, compute_ne
    from ingestion.preprocess import PreprocessState
    from ingestion.schema import SPARSE_COLUMNS
    from tests.unit.training.test_reference import _one_hot, one_blas_thread
    from training.reference import DEFAULT_C_GRID, row_id_hash, validation_rows

    config, summary = small_run
    [state_file] = config.path("features").glob("*/state.json")
    sizes = PreprocessState.load(state_file).table_sizes

    def columns(files: list[Path]) -> dict[str, np.ndarray]:
        table = pq.read_table(sorted(files), partitioning=None)
        return {name: table[name].to_numpy() for name in table.column_names}

    # the rows the served model trained on: the training day less the calibrator's share, or
    # all of it where no calibrator was kept (the held-out rows then trained it too)
    [fit_rows] = state_file.parent.glob("holdout-*/day=*/fit")
    trained = state_file.parent / "day=0" if summary["refit"] else fit_rows
    train = columns(list(trained.glob("*.parquet")))
    test = columns(list(state_file.parent.glob(f"day={config.data.eval_days[0]}/*.parquet")))
    x, y = _one_hot(train, sizes, train), train["label"]
    held_out = validation_rows(row_id_hash([train[name] for name in SPARSE_COLUMNS]), 0.1, config.training.seed)

    # strongest C first, each fit from the last one's weights (as the project fits them): the
    # same optimum, reached sooner
    by_c, path = {}, LogisticRegression(solver="lbfgs", max_iter=5_000, tol=1e-8, warm_start=True)
    for c in DEFAULT_C_GRID:
        with one_blas_thread():
            path.set_params(C=c).fit(x[~held_out], y[~held_out])
        by_c[c] = compute_ne(binary_state(y[held_out], path.predict_proba(x[held_out])[:, 1]))
    with one_blas_thread():
        reference = LogisticRegression(C=min(by_c, key=by_c.get), solver="lbfgs", max_iter=5_000, tol=1e-8).fit(x, y)
    sklearn_ne = compute_ne(binary_state(test["label"], reference.predict_proba(_one_hot(test, sizes, train))[:, 1]))
    assert summary["logistic_regression_ne"] == pytest.approx(sklearn_ne, rel=0.01)


def test_the_configured_mlps_are_narrowed_to_what_8000_rows_support_and_mlflow_records_what_trained(small_run) -> None:
    """`model.mlp_width = "auto"` (the default): the configured 512-256 MLPs train as 128-64
    on 8,000 rows; the parameters and the resolved changes in MLflow say so."""
    config, summary = small_run
    assert config.model.bottom_mlp == (512, 256, 16) and config.model.mlp_width == "auto"
    client = MlflowClient(tracking_uri=config.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["model.bottom_mlp"] == "[128, 64, 16]" and run.data.params["model.top_mlp"] == "[128, 64, 1]"
    changes = client.download_artifacts(run.info.run_id, "config/resolved_changes.json")
    width = [change for change in json.loads(Path(changes).read_text()) if change["step"] == "model width"]
    assert len(width) == 1 and "8,000 training rows" in width[0]["note"]


def test_8000_rows_start_a_wide_model_as_the_regression_by_default(small_run) -> None:
    """`model.regression_start = "auto"` (the default; the config asks for no wide part): the
    model trained is wide, started as the fitted regression (its first score, epoch 0, is the
    regression's), with the embeddings' steps capped; MLflow's parameters and changes say so."""
    config, summary = small_run
    assert not config.model.wide and config.model.regression_start == "auto" and config.training.embedding_lr == 0.05
    client = MlflowClient(tracking_uri=config.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["model.wide"] == "True" and run.data.params["model.wide_start"] == "logistic_regression"
    assert float(run.data.params["training.embedding_lr"]) == 0.005
    changes = client.download_artifacts(run.info.run_id, "config/resolved_changes.json")
    start = [change for change in json.loads(Path(changes).read_text()) if change["step"] == "regression start"]
    assert len(start) == 1 and "8,000 training rows are fewer than 32,768" in start[0]["note"]


def test_8000_rows_look_their_ids_up_in_a_vocabulary_by_default(small_run) -> None:
    """`preprocess.categorical_mode = "auto"` (the default): 8,000 training rows get a
    vocabulary, the state says so, and MLflow's parameters and changes name the mode trained."""
    from ingestion.preprocess import PreprocessState

    config, summary = small_run
    assert config.preprocess.categorical_mode == "auto"
    [state_file] = config.path("features").glob("*/state.json")
    assert PreprocessState.load(state_file).mode == "vocab"
    client = MlflowClient(tracking_uri=config.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["preprocess.categorical_mode"] == "vocab"
    changes = client.download_artifacts(run.info.run_id, "config/resolved_changes.json")
    mode = [change for change in json.loads(Path(changes).read_text()) if change["step"] == "preprocessing mode"]
    assert len(mode) == 1 and "8,000 training rows are fewer than 32,768" in mode[0]["note"]
