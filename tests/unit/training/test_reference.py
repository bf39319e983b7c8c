"""The logistic-regression reference is a converged, regularised fit: it agrees with
scikit-learn's on the same one-hot features, and beats the constant predictor on small data
where a step or two of Adagrad (the old reference) is far worse than constant."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from scipy import sparse
from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
from threadpoolctl import threadpool_limits

from evaluation.metrics import binary_state, compute_ne
from ingestion.reader import build_reader
from ingestion.schema import DENSE_COLUMNS, NUM_DENSE, SPARSE_COLUMNS
from training.reference import (
    DEFAULT_C_GRID,
    PRIOR_ROUNDS,
    PRIOR_SETTLED,
    SHRUNK,
    HashedLogisticRegression,
    fit_logistic_regression,
    fold_index,
    row_id_hash,
    train_logistic_regression,
    validation_rows,
)
from training.serving.scoring import score_files

SEED = 3
# scikit-learn's stopping rule: no gradient coordinate of its mean loss above this (a weight
# of an id seen once has a gradient of its row's residual / n).
SKLEARN_TOL = 1e-6


def _power_law_ids(rng: np.random.Generator, cardinality: int, exponent: float, n: int) -> np.ndarray:
    """Ids 1..cardinality (0 is "missing"), value k drawn ∝ 1 / k^exponent."""
    p = 1.0 / np.arange(1, cardinality + 1) ** exponent
    return 1 + rng.choice(cardinality, size=n, p=p / p.sum())


def _dataset(rng: np.random.Generator, rows: int, features: dict[str, tuple[int, float, float]], dense_weight: np.ndarray):
    """Feature rows with a logistic ground truth: per-value effects N(0, sd²) of the given
    features (cardinality, power-law exponent, sd), a linear term over log counts, every
    other categorical missing (id 0). Returns the columns and the table sizes."""
    effects = {name: rng.normal(0.0, sd, card + 1) for name, (card, _, sd) in features.items()}

    def draw(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        columns = {name: np.zeros(n, np.int32) for name in SPARSE_COLUMNS}
        for name, (card, exponent, _) in features.items():
            columns[name] = _power_law_ids(rng, card, exponent, n).astype(np.int32)
        counts = rng.exponential(rng.uniform(1, 20, NUM_DENSE), size=(n, NUM_DENSE)).astype(np.int64)
        dense = np.log1p(counts).astype(np.float32)  # the preprocessing's ln(1 + x)
        z = -1.6 + (dense - dense.mean(0)) @ dense_weight + sum(effects[k][columns[k]] for k in features)
        columns["label"] = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.int8)
        columns.update({c: dense[:, i] for i, c in enumerate(DENSE_COLUMNS)})
        return columns

    sizes = {name: 1 for name in SPARSE_COLUMNS} | {name: card + 1 for name, (card, _, _) in features.items()}
    return draw(rows, rng), draw, sizes


def _write(columns: dict[str, np.ndarray], path: Path, parts: int = 1) -> list[str]:
    """Feature Parquet as preprocessing writes it: label int8, dense float32, ids int32."""
    table = pa.table({name: columns[name] for name in ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)})
    files, step = [], -(-len(table) // parts)
    for i in range(parts):
        files.append(str(path / f"part-{i}.parquet"))
        pq.write_table(table.slice(i * step, step), files[-1], row_group_size=1024)
    return files


def _one_hot(rows: dict[str, np.ndarray], sizes: dict[str, int], train: dict[str, np.ndarray]) -> sparse.csr_matrix:
    """The same features for scikit-learn: one column per (feature, id) seen in `train`
    (an unseen id's weight is 0 under L2, in both fits), then the 13 dense columns."""

    def ids(columns: dict[str, np.ndarray]) -> np.ndarray:  # [n, 26] ids in one index space
        offsets = np.cumsum([0] + [sizes[name] for name in SPARSE_COLUMNS[:-1]])
        return np.stack([columns[name] + offsets[j] for j, name in enumerate(SPARSE_COLUMNS)], axis=1)

    seen = np.unique(ids(train))
    found = ids(rows)
    index = np.clip(np.searchsorted(seen, found), 0, len(seen) - 1)
    present = seen[index] == found
    n = len(rows["label"])
    one_hot = sparse.csr_matrix((np.ones(int(present.sum())), (np.nonzero(present)[0], index[present])), shape=(n, len(seen)))
    dense = np.column_stack([rows[c] for c in DENSE_COLUMNS]).astype(np.float64)
    return sparse.hstack([one_hot, sparse.csr_matrix(dense)]).tocsr()


def _sklearn(x: sparse.csr_matrix, y: np.ndarray, c: float) -> LogisticRegression:
    with one_blas_thread():
        return LogisticRegression(C=c, solver="lbfgs", max_iter=5_000, tol=SKLEARN_TOL).fit(x, y)


def one_blas_thread():
    """NumPy's BLAS threads right after torch's OpenMP ones fight over 2 cores (a vector dot
    product took 5 ms instead of 5 µs): one BLAS thread while scikit-learn fits."""
    return threadpool_limits(limits=1, user_api="blas")


def _sklearn_choosing_c(train: dict[str, np.ndarray], sizes: dict[str, int], grid) -> tuple[LogisticRegression, float]:
    """scikit-learn with C chosen as the project chooses it: the same hashed validation slice,
    the best validation NE over the same candidates, then a refit on every training row."""
    x, y = _one_hot(train, sizes, train), train["label"]
    held_out = validation_rows(row_id_hash([train[name] for name in SPARSE_COLUMNS]), 0.1, SEED)
    ne, model = {}, LogisticRegression(solver="lbfgs", max_iter=5_000, tol=SKLEARN_TOL, warm_start=True)
    for c in grid:  # strongest first, each fit starting from the previous one (as the project's)
        with one_blas_thread():
            model.set_params(C=c).fit(x[~held_out], y[~held_out])
        ne[c] = compute_ne(binary_state(y[held_out], model.predict_proba(x[held_out])[:, 1]))
    best = min(ne, key=ne.get)
    return _sklearn(x, y, best), best


def _ne_of_model(model: torch.nn.Module, files: list[str]) -> float:
    scores = score_files(model, files, "C1")
    return compute_ne(binary_state(scores.labels, scores.predictions))


def _old_reference(sizes: dict[str, int], files: list[str]) -> HashedLogisticRegression:
    """The reference as it was: one pass of Adagrad (lr 0.1) at batch 4096."""
    torch.manual_seed(SEED)
    model = HashedLogisticRegression(sizes)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for batch in build_reader(files, 4096, shuffle_seed=SEED):
        optimizer.zero_grad()
        torch.nn.BCEWithLogitsLoss()(model(batch.dense_features, batch.sparse_features), batch.labels).backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def signal_data(tmp_path_factory: pytest.TempPathFactory):
    """4,000 training rows, 2,000 held out: six informative categoricals (4 to 1,000 values),
    four pure-noise ones, three informative dense counts."""
    rng = np.random.default_rng(1)
    features = {"C1": (4, 0.5, 0.6), "C2": (10, 0.8, 0.5), "C3": (30, 1.0, 0.5), "C4": (100, 1.0, 0.4),
                "C5": (300, 1.1, 0.4), "C6": (1000, 1.1, 0.3)} | {f"C{k}": (500, 1.0, 0.0) for k in range(7, 11)}  # fmt: skip
    dense_weight = np.r_[0.4, -0.3, 0.2, np.zeros(NUM_DENSE - 3)]
    train, draw, sizes = _dataset(rng, 4000, features, dense_weight)
    test = draw(2000, rng)
    root = tmp_path_factory.mktemp("lr-signal")
    for part in ("train", "test"):
        (root / part).mkdir()
    return train, test, sizes, _write(train, root / "train", parts=2), _write(test, root / "test")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory):
    """4,500 training rows (one step at batch 4096), 2,000 held out; weak signal, and eight
    features with 20,000 values each: most of their ids are seen once."""
    rng = np.random.default_rng(2)
    features = {"C1": (3, 0.5, 0.5), "C2": (12, 0.8, 0.5), "C3": (60, 1.0, 0.4)}
    features |= {f"C{k}": (20_000, 1.05, 0.3) for k in range(4, 12)}
    dense_weight = np.r_[0.35, -0.25, np.zeros(NUM_DENSE - 2)]
    train, draw, sizes = _dataset(rng, 4500, features, dense_weight)
    test = draw(2000, rng)
    root = tmp_path_factory.mktemp("lr-small")
    for part in ("train", "test"):
        (root / part).mkdir()
    return train, test, sizes, _write(train, root / "train"), _write(test, root / "test")


def test_agrees_with_sklearn_on_data_with_signal(signal_data) -> None:
    train, test, sizes, train_files, test_files = signal_data
    fit = fit_logistic_regression(sizes, train_files, seed=SEED, folds=1)
    ne = _ne_of_model(fit.model, test_files)
    assert set(fit.validation_ne_by_c) <= set(DEFAULT_C_GRID) and len(fit.validation_ne_by_c) >= 3
    reference, c = _sklearn_choosing_c(train, sizes, fit.validation_ne_by_c)
    sklearn_ne = compute_ne(binary_state(test["label"], reference.predict_proba(_one_hot(test, sizes, train))[:, 1]))
    print(f"signal: NE {ne:.5f} (C {fit.c:.4g}, validation NE {fit.validation_ne:.4f}), sklearn {sklearn_ne:.5f} (C {c:.4g})")
    assert fit.converged and fit.c == c, "the same C is chosen on the same validation slice"
    assert 350 < fit.validation_rows < 450 and fit.train_rows == 4000
    assert ne < 0.95, "the fixture's signal is learnt"
    assert abs(ne - sklearn_ne) < 0.01 * sklearn_ne
    # At the same C, both solved tightly, the two solve one problem: the same predictions.
    tight = fit_logistic_regression(sizes, train_files, seed=SEED, c_grid=(fit.c,), tolerance=1e-12)
    with one_blas_thread():
        same_c = LogisticRegression(C=fit.c, max_iter=5_000, tol=1e-10).fit(_one_hot(train, sizes, train), train["label"])
    ours = score_files(tight.model, test_files, "C1").predictions
    np.testing.assert_allclose(ours, same_c.predict_proba(_one_hot(test, sizes, train))[:, 1], atol=1e-5)
    assert np.isclose(fit.l2, 1.0 / (fit.c * fit.train_rows))


def test_beats_the_constant_on_small_sparse_data_where_the_old_reference_did_not(small_data) -> None:
    train, test, sizes, train_files, test_files = small_data
    ids = np.concatenate([train[name] + 100_000 * j for j, name in enumerate(SPARSE_COLUMNS[3:11])])
    _, counts = np.unique(ids, return_counts=True)
    assert np.mean(counts == 1) > 0.5, "most ids of the wide features are seen once"
    fit = fit_logistic_regression(sizes, train_files, seed=SEED, folds=1)
    ne = _ne_of_model(fit.model, test_files)
    reference, _ = _sklearn_choosing_c(train, sizes, fit.validation_ne_by_c)
    sklearn_ne = compute_ne(binary_state(test["label"], reference.predict_proba(_one_hot(test, sizes, train))[:, 1]))
    constant_ne = compute_ne(binary_state(test["label"], np.full(len(test["label"]), train["label"].mean())))
    old_ne = _ne_of_model(_old_reference(sizes, train_files), test_files)
    print(f"small: NE {ne:.5f} (C {fit.c:.4g}), sklearn {sklearn_ne:.5f}, constant {constant_ne:.5f}, old {old_ne:.4f}")
    assert ne < constant_ne - 0.005 and fit.converged
    assert abs(ne - sklearn_ne) < 0.01 * sklearn_ne
    assert old_ne > constant_ne + 0.05, "one pass of Adagrad at batch 4096 is far worse than constant"


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_the_same_rows_give_the_same_weights_and_the_slice_ignores_file_order(signal_data) -> None:
    _, _, sizes, train_files, _ = signal_data
    for folds in (1, 5):  # one slice, and the folds of cross-validation
        first = fit_logistic_regression(sizes, train_files, seed=SEED, c_grid=(0.1,), folds=folds)
        again = fit_logistic_regression(sizes, train_files, seed=SEED, c_grid=(0.1,), folds=folds)
        assert torch.equal(first.model.weights.weight, again.model.weights.weight)
        assert torch.equal(first.model.dense.weight, again.model.dense.weight)
        swapped = fit_logistic_regression(sizes, train_files[::-1], seed=SEED, c_grid=(0.1,), folds=folds)
        assert swapped.validation_rows == first.validation_rows
        assert np.isclose(swapped.validation_ne, first.validation_ne, rtol=1e-5), "the same rows, summed in another order"
        other_salt = fit_logistic_regression(sizes, train_files, seed=SEED + 1, c_grid=(0.1,), folds=folds)
        assert other_salt.validation_ne != first.validation_ne


def test_train_logistic_regression_keeps_its_call(signal_data) -> None:
    _, _, sizes, train_files, test_files = signal_data
    model = train_logistic_regression(sizes, train_files, seed=SEED, c_grid=(0.1,))
    assert isinstance(model, HashedLogisticRegression) and not model.training
    assert _ne_of_model(model, test_files) < 1.0


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_multi_hot_bags_are_summed_like_the_model_sums_them(multi_hot_features) -> None:
    state, files = multi_hot_features
    fit = fit_logistic_regression(state.table_sizes, files[0] + files[1], seed=SEED)
    scores = score_files(fit.model, files[2], "C3")
    constant = np.full(len(scores.labels), state.train_click_rate)
    assert fit.converged and fit.train_rows == 8000
    assert compute_ne(binary_state(scores.labels, scores.predictions)) < compute_ne(binary_state(scores.labels, constant)) - 0.02


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_max_rows_fits_a_fixed_hashed_sample_and_still_learns(signal_data) -> None:
    train, test, sizes, train_files, test_files = signal_data
    full = fit_logistic_regression(sizes, train_files, seed=SEED)
    sampled = fit_logistic_regression(sizes, train_files, seed=SEED, max_rows=2000)
    again = fit_logistic_regression(sizes, train_files, seed=SEED, max_rows=2000)
    assert full.train_rows == full.rows_available == 4000
    assert sampled.rows_available == 4000 and 1800 <= sampled.train_rows <= 2200, sampled.train_rows
    assert again.train_rows == sampled.train_rows and again.c == sampled.c, "the same rows every run"
    sampled_ne = _ne_of_model(sampled.model, test_files)
    constant = compute_ne(binary_state(test["label"], np.full(len(test["label"]), train["label"].mean())))
    assert _ne_of_model(full.model, test_files) <= sampled_ne < constant, "half the rows: worse, still informative"


def _sklearn_cross_validated(train: dict[str, np.ndarray], sizes: dict[str, int], grid, folds: int):
    """scikit-learn with C chosen as the project chooses it on few rows: the same hashed folds,
    the out-of-fold predictions of every fold pooled into one NE per C, then a refit. Returns
    the refit, the C, the NE by C and the chosen C's out-of-fold predictions."""
    x, y = _one_hot(train, sizes, train), train["label"]
    fold = fold_index(row_id_hash([train[name] for name in SPARSE_COLUMNS]), folds, SEED)
    ne, out_of_fold = {}, {}
    for c in grid:
        predictions = np.empty(len(y))
        for f in range(folds):
            predictions[fold == f] = _sklearn(x[fold != f], y[fold != f], c).predict_proba(x[fold == f])[:, 1]
        ne[c], out_of_fold[c] = compute_ne(binary_state(y, predictions)), predictions
    best = min(ne, key=ne.get)
    return _sklearn(x, y, best), best, ne, out_of_fold[best]


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_on_few_rows_c_is_chosen_by_cross_validation_as_scikit_learn_chooses_it(small_data) -> None:
    """4,500 rows: 5 folds, each row scored once out of fold; the same C and the same NE as
    scikit-learn's on the same folds, and no worse than a careful analyst's scikit-learn search
    (its own stratified folds over a fine grid of C)."""
    train, test, sizes, train_files, test_files = small_data
    fit = fit_logistic_regression(sizes, train_files, seed=SEED)
    assert fit.folds == 5 and fit.validation_rows == fit.train_rows == 4500 and fit.converged
    assert "5-fold cross-validation over 4,500 training rows" in fit.how_chosen
    reference, c, ne_by_c, sklearn_out_of_fold = _sklearn_cross_validated(train, sizes, fit.validation_ne_by_c, 5)
    assert fit.c == c, (fit.validation_ne_by_c, ne_by_c)
    for tried, ne in fit.validation_ne_by_c.items():
        assert abs(ne - ne_by_c[tried]) < 2e-3 * ne, (tried, ne, ne_by_c[tried])
    # each row's out-of-fold prediction, in the files' row order, is scikit-learn's on the same folds
    assert fit.out_of_fold is not None and fit.out_of_fold.shape == (4500,)
    difference = np.abs(fit.out_of_fold - sklearn_out_of_fold)
    print(f"out of fold: mean |difference| {difference.mean():.2e}, largest {difference.max():.2e}")
    assert difference.mean() < 2e-4 and difference.max() < 2e-3
    one_hot_test = _one_hot(test, sizes, train)
    sklearn_ne = compute_ne(binary_state(test["label"], reference.predict_proba(one_hot_test)[:, 1]))
    with one_blas_thread():  # the analyst keeps scikit-learn's tolerance (1e-4): 5 s, not 25 s at 1e-6, the same C
        analyst = LogisticRegressionCV(Cs=np.logspace(-4, 1, 21).tolist(), cv=5, scoring="neg_log_loss",
                                       max_iter=5_000).fit(_one_hot(train, sizes, train), train["label"])  # fmt: skip
    analyst_ne = compute_ne(binary_state(test["label"], analyst.predict_proba(one_hot_test)[:, 1]))
    ne = _ne_of_model(fit.model, test_files)
    print(f"cross-validated: NE {ne:.5f} (C {fit.c:.4g}), sklearn same folds {sklearn_ne:.5f}, "
          f"analyst {analyst_ne:.5f} (C {analyst.C_[0]:.4g})")
    assert abs(ne - sklearn_ne) < 1e-3 * sklearn_ne
    assert ne < analyst_ne * 1.005


def _planted_pair(rng: np.random.Generator, n: int, effects: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """C1 (5 values) and C2 (7) with their own effects and one of their combination; C3 noise."""
    columns = {name: np.zeros(n, np.int32) for name in SPARSE_COLUMNS}
    columns["C1"], columns["C2"] = rng.integers(1, 6, n).astype(np.int32), rng.integers(1, 8, n).astype(np.int32)
    columns["C3"] = rng.integers(1, 20, n).astype(np.int32)
    own_1, own_2, pair = effects
    z = -1.0 + own_1[columns["C1"]] + own_2[columns["C2"]] + pair[columns["C1"], columns["C2"]]
    columns["label"] = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.int8)
    columns.update({c: np.zeros(n, np.float32) for c in DENSE_COLUMNS})
    return columns


def _crossed_ne(model: torch.nn.Module, files: list[str], crosses) -> float:
    labels, predictions = [], []
    with torch.no_grad():
        for batch in build_reader(files, 4096, drop_remainder=False, crosses=crosses):
            keep = batch.labels != -1
            labels.append(batch.labels[keep].numpy())
            predictions.append(torch.sigmoid(model(batch.dense_features, batch.sparse_features))[keep].numpy())
    return compute_ne(binary_state(np.concatenate(labels), np.concatenate(predictions)))


def test_a_crossed_pair_is_fitted_on_the_plain_fits_rows_and_learns_what_the_pair_adds(tmp_path: Path) -> None:
    from ingestion.cross_ids import Cross
    from ingestion.crosses import cross_table_rows

    rng = np.random.default_rng(5)
    effects = (rng.normal(0, 0.4, 6), rng.normal(0, 0.4, 8), rng.normal(0, 0.9, (6, 8)))
    train, test = _planted_pair(rng, 5_000, effects), _planted_pair(rng, 2_000, effects)
    for part in ("train", "test"):
        (tmp_path / part).mkdir()
    train_files, test_files = _write(train, tmp_path / "train", parts=2), _write(test, tmp_path / "test")
    sizes = {name: 1 for name in SPARSE_COLUMNS} | {"C1": 6, "C2": 8, "C3": 20}
    cross = Cross("C1", "C2", cross_table_rows(train["C1"], train["C2"], 1_000))
    plain = fit_logistic_regression(sizes, train_files, seed=SEED, folds=1)
    crossed = fit_logistic_regression(sizes | {cross.name: cross.rows}, train_files, seed=SEED, folds=1, crosses=(cross,))
    assert crossed.model.features == [*sizes, "C1_x_C2"]
    # the same held-out slice: the rows are hashed by the files' own features, not the cross
    assert plain.out_of_fold is not None and crossed.out_of_fold is not None
    np.testing.assert_array_equal(np.isfinite(plain.out_of_fold), np.isfinite(crossed.out_of_fold))
    assert crossed.validation_ne < plain.validation_ne * 0.97, (crossed.validation_ne, plain.validation_ne)
    crossed_ne, plain_ne = _crossed_ne(crossed.model, test_files, (cross,)), _ne_of_model(plain.model, test_files)
    print(f"held out: plain {plain_ne:.4f}, crossed {crossed_ne:.4f}")
    assert crossed_ne < plain_ne * 0.97


def test_each_features_own_prior_shrinks_the_noise_and_is_the_fit_scikit_learn_makes_at_those_strengths(signal_data) -> None:
    """`per_feature_l2`: the four features of pure noise get a far smaller C (prior variance)
    than the informative ones, the held-out NE beats the one-C fit's, and the weights are
    scikit-learn's at those strengths (each feature's one-hot columns scaled by √(C_f / C),
    an independent solver of the same problem); the strengths are their own fixed point:
    each feature's C is the mean of w² + 1 / (Σ p(1 − p) + 1 / C_f) over its ids."""
    train, test, sizes, train_files, test_files = signal_data
    shared = fit_logistic_regression(sizes, train_files, seed=SEED, folds=1)
    own = fit_logistic_regression(sizes, train_files, seed=SEED, folds=1, per_feature_l2=True, tolerance=1e-12)
    assert not shared.c_by_feature and own.c == shared.c and own.validation_ne == pytest.approx(shared.validation_ne)
    informative, noise = [f"C{k}" for k in range(1, 7)], [f"C{k}" for k in range(7, 11)]
    assert set(own.c_by_feature) == set(SPARSE_COLUMNS), "every feature (the others: id 0 on every row), each its own C"
    assert all(own.c_by_feature[name] < own.c for name in noise), "the noise is shrunk below the validated C"
    assert max(own.c_by_feature[name] for name in informative) > 5 * max(own.c_by_feature[name] for name in noise)
    assert "type-II maximum likelihood" in own.how_chosen and 1 < own.prior_rounds <= PRIOR_ROUNDS
    shared_ne, own_ne = _ne_of_model(shared.model, test_files), _ne_of_model(own.model, test_files)
    print(f"per-feature C: {own.c_by_feature} ({own.prior_rounds} rounds); NE {own_ne:.5f} against one C's {shared_ne:.5f}")
    assert own_ne < shared_ne
    # the columns of _one_hot: the ids seen, in one index space ordered as SPARSE_COLUMNS, then the dense
    offsets = np.cumsum([0] + [sizes[name] for name in SPARSE_COLUMNS])
    seen = np.unique(np.stack([train[name] + offsets[j] for j, name in enumerate(SPARSE_COLUMNS)], axis=1))
    feature_of = [SPARSE_COLUMNS[j] for j in np.searchsorted(offsets, seen, side="right") - 1]
    c_of = np.array([own.c_by_feature[name] for name in feature_of])
    scale = np.r_[np.sqrt(c_of / own.c), np.ones(NUM_DENSE)]
    x, x_test = _one_hot(train, sizes, train), _one_hot(test, sizes, train)
    with one_blas_thread():
        oracle = LogisticRegression(C=own.c, max_iter=10_000, tol=1e-10).fit(x @ sparse.diags(scale), train["label"])
    expected = oracle.predict_proba(x_test @ sparse.diags(scale))[:, 1]
    np.testing.assert_allclose(score_files(own.model, test_files, "C1").predictions, expected, atol=1e-5)
    weights = oracle.coef_[0] * scale
    p = oracle.predict_proba(x @ sparse.diags(scale))[:, 1]
    curvature = np.asarray(x[:, : len(seen)].T @ (p * (1 - p))).reshape(-1)
    posterior = 1.0 / (curvature + 1.0 / c_of)
    for name in (name for name in SPARSE_COLUMNS if own.c_by_feature[name] >= SHRUNK * own.c):
        mine = np.array(feature_of) == name
        settled = float(np.mean(weights[: len(seen)][mine] ** 2 + posterior[mine]))
        within = PRIOR_SETTLED if own.prior_rounds < PRIOR_ROUNDS else 0.1  # ten rounds may stop short of settling
        assert settled == pytest.approx(own.c_by_feature[name], rel=within), name
