"""Reference models that every DLRM is reported against.

`HashedLogisticRegression`: one weight per (feature, hashed value) plus a linear term over
the log-scaled counts: the classic CTR baseline, on exactly the DLRM's features. It sees
each feature on its own, so it cannot learn feature interactions; a DLRM that does not beat
it on data with interactions has not learned them either.

A reference only means something if it is the best model of its kind, so it is fitted to
convergence, not trained for a step or two: full-batch L-BFGS (float64) on

    mean log loss + λ/2 · (‖sparse weights‖² + ‖dense weights‖²)      (the bias is free)

which is scikit-learn's `LogisticRegression(C=1 / (λ·n))` on the one-hot features. C is
chosen on validation rows that are not the evaluation days, picked by a hash of each row's
ids (the same rows whatever the file order): on few training rows (under `CV_BELOW_ROWS`)
by k-fold cross-validation, every row scored once by a fit that did not see it (a slice of
a few hundred rows would pick C by its noise); on more, on one slice of the training rows,
the rest fitted for each C tried. The chosen C is then refitted on every training row.
Full batch, fixed starts: the same rows give the same weights.

`per_feature_l2`: one L2 strength for every weight treats a feature of three values, each
seen thousands of times, as it treats one of thousands of ids each seen once. With it, each
feature's ids get a prior variance of their own, by type-II maximum likelihood (empirical
Bayes): from the validated C, each round sets a feature's variance to the mean over its ids
of w² + v (the weight and its Laplace posterior variance, 1 / (Σ p(1 − p) over its rows +
1 / variance)) and fits again (an EM step), until no variance moves by 2 % (`PRIOR_ROUNDS`
at most). The bias and the dense weights keep the validated L2. This is the fit a wide model
starts from; the reported reference stays the one-C regression a careful analyst would fit.
EM moves a feature of many rarely seen ids slowly away from the validated C, so ten rounds
stop between the one C and the marginal likelihood's optimum; MacKay's update, which reaches
that optimum in a few rounds, measured worse on all three small datasets tried (Avazu,
MovieLens's four weeks, configs/small-real.toml: docs/run-length.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from evaluation.metrics import binary_state, compute_ne
from ingestion.count_bins import CountBins
from ingestion.cross_ids import Cross
from ingestion.reader import PAD_LABEL, build_reader, example_of_values
from training.model.stock_dlrm import DENSE_FEATURES

# Candidate inverse L2 strengths (scikit-learn's C: C·Σ loss + ½‖w‖²), half a decade apart.
# Salts the row sample of `max_rows`, so it is not the validation slice (salted by the seed).
SAMPLE_SALT = 0x5A3B1E
DEFAULT_C_GRID: tuple[float, ...] = tuple(10.0 ** (k / 2) for k in range(-7, 3))  # 3.2e-4 … 10
# Where the search starts: 1e4 real Criteo rows chose C ≈ 0.03, 6e5 generated rows C ≈ 0.1.
START_C = 0.03
# Below this many training rows C is chosen by `CV_FOLDS`-fold cross-validation: each fit is
# cheap there, and one 10 % slice (under 20,000 rows) is too few rows to choose by.
CV_BELOW_ROWS = 200_000
CV_FOLDS = 5
# Rounds of the per-feature prior variances at most, and the relative change that ends them.
PRIOR_ROUNDS = 10
PRIOR_SETTLED = 0.02
SHRUNK = 0.01  # a feature whose C fell below this share of the validated C counts as settled
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class HashedLogisticRegression(nn.Module):
    """`raw_ids`: the features hold raw ids (managed mode), hashed here into the table's rows
    as hash mode would (id mod rows), since the model's own rows depend on its training."""

    def __init__(self, table_sizes: Mapping[str, int], dense_features: int = DENSE_FEATURES, raw_ids: bool = False) -> None:
        super().__init__()
        self.features = list(table_sizes)  # the KJT keys, in this order
        self.raw_ids = raw_ids
        sizes = [table_sizes[name] for name in self.features]
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.int64))
        self.register_buffer("offsets", torch.tensor(np.concatenate(([0], np.cumsum(sizes[:-1]))), dtype=torch.int64))
        self.weights = nn.EmbeddingBag(int(sum(sizes)), 1, mode="sum", sparse=True)
        nn.init.zeros_(self.weights.weight)
        self.dense = nn.Linear(dense_features, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """dense [B, D], the sparse features (multi-hot bags summed) → logits [B]."""
        batch = dense.shape[0]
        if sparse.keys() != self.features:
            sparse = sparse.permute([sparse.keys().index(name) for name in self.features])
        # every id moved into its feature's block of the one weight table
        per_key = torch.tensor(sparse.length_per_key())
        ids = sparse.values()
        if self.raw_ids:
            ids = torch.remainder(ids, torch.repeat_interleave(self.sizes, per_key))
        ids = ids + torch.repeat_interleave(self.offsets, per_key)
        per_bag = self.weights(ids, sparse.offsets()[:-1].to(torch.int64))  # [F·B, 1], feature-major
        return per_bag.view(len(self.features), batch).sum(0) + self.dense(dense).squeeze(-1)


@dataclass(frozen=True)
class LogisticFit:
    """The fitted reference and how its L2 strength was chosen."""

    model: HashedLogisticRegression
    l2: float  # λ of the final fit: mean log loss + λ/2‖w‖² over all `train_rows`
    c: float  # the same strength as scikit-learn's C = 1 / (λ · train_rows)
    validation_ne: float  # at this C, fitted without the validation rows, NE on them (NaN: not chosen)
    validation_ne_by_c: dict[float, float]  # every C tried, in the order tried
    train_rows: int
    validation_rows: int  # the rows C was judged on (with folds > 1: every row, out of fold)
    iterations: int  # L-BFGS iterations of the final fit
    converged: bool  # the final fit met its stopping rule before `max_iter`
    rows_available: int = 0  # training rows in the files (train_rows: those fitted, with `max_rows`)
    folds: int = 1  # k of the k-fold cross-validation that chose C (1: one held-out slice)
    # [train_rows] each fitted row's prediction at the chosen C by the fit that did not see it,
    # in the files' row order (every row of the files unless `max_rows` sampled them; NaN for
    # the rows no fit left out: those fitted with one held-out slice); None when C was not
    # validated. What a pair of columns is scored against (ingestion/crosses.py).
    out_of_fold: np.ndarray | None = field(default=None, compare=False, repr=False)
    # `per_feature_l2`: each feature's C (the prior variance of its ids' weights), and the
    # rounds that estimated them; empty where one C serves every weight
    c_by_feature: dict[str, float] = field(default_factory=dict)
    prior_rounds: int = 0

    @property
    def how_chosen(self) -> str:
        """How C was chosen, for the log and the report."""
        if not self.validation_ne_by_c:
            return f"C {self.c:.4g} unvalidated (too few rows of each label to choose by)"
        where = (f"by {self.folds}-fold cross-validation over {self.validation_rows:,} training rows" if self.folds > 1
                 else f"on {self.validation_rows:,} held-out training rows")  # fmt: skip
        chosen = f"C {self.c:.4g} chosen {where} (validation NE {self.validation_ne:.4f}, {len(self.validation_ne_by_c)} C tried)"
        if not self.c_by_feature:
            return chosen
        low, high = min(self.c_by_feature, key=self.c_by_feature.get), max(self.c_by_feature, key=self.c_by_feature.get)
        return (f"{chosen}; then each feature's own C by type-II maximum likelihood ({self.prior_rounds} rounds): "
                f"from {self.c_by_feature[low]:.3g} ({low}) to {self.c_by_feature[high]:.3g} ({high})")


@dataclass(frozen=True)
class _Rows:
    """Rows as a sparse one-hot design over the (feature, id) columns seen in training."""

    dense: torch.Tensor  # [n, D] float64
    ids: torch.Tensor  # [n, m] CSR float64: 1 per id (a repeated id of a bag counts twice)
    ids_t: torch.Tensor  # [m, n] CSR: the transpose, so X^T r is a row-parallel product too
    labels: torch.Tensor  # [n] float64


def train_logistic_regression(
    table_sizes: Mapping[str, int], train_files: Sequence[str], seed: int = 0, **options
) -> HashedLogisticRegression:
    """The converged, regularised reference; see `fit_logistic_regression` for `options`."""
    return fit_logistic_regression(table_sizes, train_files, seed=seed, **options).model


def fit_logistic_regression(
    table_sizes: Mapping[str, int],
    train_files: Sequence[str],
    seed: int = 0,
    *,
    c_grid: Sequence[float] = DEFAULT_C_GRID,
    validation_fraction: float = 0.1,
    max_iter: int = 500,
    tolerance: float = 1e-6,
    batch_size: int = 65_536,
    max_rows: int = 0,
    raw_ids: bool = False,
    folds: int = 0,
    crosses: Sequence[Cross] = (),
    per_feature_l2: bool = False,
    count_bins: Sequence[CountBins] = (),
) -> LogisticFit:
    """Choose C on hashed validation rows of the training rows, refit on all of them.

    `folds`: k-fold cross-validation with k > 1; 1: one slice of `validation_fraction` of
    the rows; 0 (default): `CV_FOLDS` below `CV_BELOW_ROWS` training rows, else one slice.
    `seed` salts the slice (and the folds). The search starts at the grid's C nearest `START_C` and walks
    towards weaker (then, if that got worse at once, stronger) regularisation while the
    validation NE improves, each fit warm-started from its neighbour's. A fit stops when
    10 L-BFGS iterations lower the objective by less than `tolerance` (relative), or after
    `max_iter`. The rows fitted are held in memory: at the peak about 1.7 GB per million
    rows (26 ids each). `max_rows` > 0 fits on a sample of about that many training rows,
    picked by a hash of each row (the same rows on every run); 0 fits on all. `raw_ids`: the
    files hold raw ids (managed mode), hashed into the tables' rows (id mod rows). `crosses`:
    the crossed pairs' columns too (their tables among `table_sizes`); the folds and the
    sample stay those of the plain features, so the fits with and without compare row for row.
    `count_bins`: the bin columns of dense features too, alike.
    `per_feature_l2`: from the validated C, each feature's own (the module's docstring); an
    unvalidated C is kept for every weight.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction: must be in (0, 1), got {validation_fraction}")
    features = list(table_sizes)
    sizes = [table_sizes[name] for name in features]
    total = sum(pq.ParquetFile(f).metadata.num_rows for f in train_files)
    sample = min(1.0, max_rows / total) if max_rows and total else 1.0
    dense, ids, rows_of_ids, labels, row_hash = _read_training_rows(train_files, features, sizes, batch_size, sample,
                                                                    raw_ids, crosses, count_bins)  # fmt: skip
    n = len(labels)
    k = folds or (CV_FOLDS if n < CV_BELOW_ROWS else 1)
    # each row's fold: with k = 1 the validation slice is "fold 0", the rest "fold 1"
    slice_ = (~validation_rows(row_hash, validation_fraction, seed)).astype(np.int64)
    fold_of = fold_index(row_hash, k, seed) if k > 1 else slice_
    seen = np.bincount(ids, minlength=int(sum(sizes))) > 0  # only the ids seen get a column
    columns, column_of = np.flatnonzero(seen), (np.cumsum(seen, dtype=np.int64) - 1)[ids].astype(np.int32)
    del ids

    def design(rows: np.ndarray) -> _Rows:
        return _design(dense, column_of, rows_of_ids, labels, len(columns), rows)

    def fit(rows: _Rows, c: float, start: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        return _lbfgs(rows, 1.0 / (c * len(rows.labels)), start, max_iter, tolerance)

    splits = [(design(fold_of != f), design(fold_of == f)) for f in range(k)]
    ne_by_c, c, thetas = _choose_c(splits, fit, c_grid, len(columns))
    out_of_fold = _out_of_fold(splits, thetas, fold_of) if ne_by_c else None
    start = thetas[0]
    validation = int(np.sum(fold_of == 0)) if k == 1 else n
    del splits
    everything = design(np.ones(n, dtype=bool))  # after the validation designs are freed
    theta, iterations, converged = fit(everything, c, start)
    c_by_feature: dict[str, float] = {}
    rounds = 0
    if per_feature_l2 and ne_by_c:
        feature_of_column = np.searchsorted(np.cumsum(sizes), columns, side="right")
        theta, c_of_feature, rounds, iterations, converged = _per_feature_priors(
            everything, theta, feature_of_column, len(features), c, max_iter, tolerance)
        c_by_feature = {features[f]: float(c_of_feature[f]) for f in np.unique(feature_of_column)}
    model = _to_model(table_sizes, theta, columns, raw_ids)
    return LogisticFit(model, 1.0 / (c * n), c, ne_by_c.get(c, math.nan), ne_by_c, n, validation,
                       iterations, converged, total, k, out_of_fold, c_by_feature, rounds)  # fmt: skip


def _per_feature_priors(rows: _Rows, theta: torch.Tensor, feature_of_column: np.ndarray, features: int, c: float,
                        max_iter: int, tolerance: float) -> tuple[torch.Tensor, np.ndarray, int, int, bool]:  # fmt: skip
    """Each feature's prior variance of its ids' weights (scikit-learn's C: the variance on the
    summed log loss' scale) by type-II maximum likelihood, from `theta`, the fit at one C:
    (θ, C by feature, rounds, the last fit's iterations, converged). The Hessian's diagonal
    counts a bag's repeated id once per appearance (p(1 − p) per entry), not by its square."""
    n = len(rows.labels)
    d = rows.dense.shape[1]
    owner = torch.from_numpy(feature_of_column.astype(np.int64))
    ids_per_feature = torch.bincount(owner, minlength=features).to(torch.float64)
    has_ids = ids_per_feature > 0
    ids_per_feature = ids_per_feature.clamp_min(1.0)
    c_of_feature = torch.full((features,), c, dtype=torch.float64)
    penalty = torch.full_like(theta, 1.0 / (c * n))
    penalty[0] = 0.0
    rounds, iterations, converged = 0, 0, True
    for rounds in range(1, PRIOR_ROUNDS + 1):
        p = torch.from_numpy(_predict(rows, theta))
        curvature = rows.ids_t @ (p * (1.0 - p))  # [m] Σ p(1 − p) over each id's rows
        weights = theta[1 + d :]
        posterior = 1.0 / (curvature + 1.0 / c_of_feature[owner])
        settled = torch.zeros(features, dtype=torch.float64).index_add_(0, owner, weights * weights + posterior)
        settled = (settled / ids_per_feature).clamp_min(1e-12)
        # a feature shrunk to under 1 % of C (a constant column, the bias' twin, or noise) goes on
        # shrinking by a few % a round with no effect on a prediction: it does not hold the rounds
        live = has_ids & (settled >= SHRUNK * c)
        moved = float(((settled - c_of_feature).abs() / c_of_feature)[live].max()) if bool(live.any()) else 0.0
        c_of_feature = settled
        penalty[1 + d :] = 1.0 / (c_of_feature[owner] * n)
        theta, iterations, converged = _lbfgs(rows, penalty, theta, max_iter, tolerance)
        if moved <= PRIOR_SETTLED:
            break
    return theta, c_of_feature.numpy(), rounds, iterations, converged


def _choose_c(splits: list[tuple[_Rows, _Rows]], fit, c_grid: Sequence[float], columns: int):
    """(validation NE by C tried, the chosen C, each split's fit at it: the first starts the
    refit), the NE of each C pooled over the splits' (fit, check) pairs: every check row
    scored by the fit that did not see it."""
    first = splits[0][0]
    ctr = float(first.labels.mean()) if len(first.labels) else 0.5
    start = torch.zeros(1 + first.dense.shape[1] + columns, dtype=torch.float64)
    start[0] = math.log(max(ctr, 1e-6) / max(1.0 - ctr, 1e-6))  # the constant predictor
    if not all(_both_classes(check.labels) and _both_classes(rows.labels) for rows, check in splits):
        return {}, _nearest(sorted(c_grid), START_C), [start]  # too few rows to choose: unvalidated
    labels = np.concatenate([check.labels.numpy() for _, check in splits])

    def pooled_ne(thetas: list[torch.Tensor]) -> float:
        predictions = np.concatenate([_predict(check, theta) for (_, check), theta in zip(splits, thetas, strict=True)])
        return compute_ne(binary_state(labels, predictions))

    def fit_each(c: float, warm: list[torch.Tensor]) -> list[torch.Tensor]:
        return [fit(rows, c, theta)[0] for (rows, _), theta in zip(splits, warm, strict=True)]

    ne_by_c, c, thetas = _search_c(fit_each, pooled_ne, c_grid, [start] * len(splits))
    return ne_by_c, c, thetas


def _out_of_fold(splits: list[tuple[_Rows, _Rows]], thetas: list[torch.Tensor], fold_of: np.ndarray) -> np.ndarray:
    """Each row's prediction by the split's fit that left it out; a split's check rows are
    the rows of its fold in file order (NaN where no split checks a row)."""
    predictions = np.full(len(fold_of), np.nan)
    for f, ((_, check), theta) in enumerate(zip(splits, thetas, strict=True)):
        predictions[fold_of == f] = _predict(check, theta)
    return predictions


def _search_c(fit, validation_ne, c_grid: Sequence[float], start: Any):
    """Walk the grid from `START_C` while validation NE improves: (NE by C, best C, its θ)."""
    grid = sorted(c_grid)
    first = grid.index(_nearest(grid, START_C))
    thetas = {first: fit(grid[first], start)}
    ne_by_c = {grid[first]: validation_ne(thetas[first])}
    best = first
    for step in (+1, -1):  # weaker first; stronger only if the first weaker step did worse
        i = first
        while 0 <= i + step < len(grid):
            thetas[i + step] = fit(grid[i + step], thetas[i])
            ne_by_c[grid[i + step]] = validation_ne(thetas[i + step])
            if ne_by_c[grid[i + step]] >= ne_by_c[grid[best]]:
                break
            best = i = i + step
        if best != first:
            break
    return ne_by_c, grid[best], thetas[best]


def _nearest(grid: Sequence[float], c: float) -> float:
    return min(grid, key=lambda g: abs(math.log(g / c)))


def validation_rows(row_hash: np.ndarray, fraction: float, seed: int = 0) -> np.ndarray:
    """[n] bool: the rows whose salted id hash falls in the lowest `fraction` of the range."""
    mixed = _splitmix64(row_hash ^ _splitmix64(np.full(1, seed, dtype=np.uint64)))
    return (mixed >> np.uint64(11)).astype(np.float64) < fraction * 2.0**53


def fold_index(row_hash: np.ndarray, folds: int, seed: int = 0) -> np.ndarray:
    """[n] int64 in 0..folds-1: each row's fold, from the same salted hash as `validation_rows`."""
    mixed = _splitmix64(row_hash ^ _splitmix64(np.full(1, seed, dtype=np.uint64)))
    return np.minimum(((mixed >> np.uint64(11)).astype(np.float64) / 2.0**53 * folds).astype(np.int64), folds - 1)


def row_id_hash(first_ids: Sequence[np.ndarray]) -> np.ndarray:
    """[n] uint64: a hash of each row's ids (one array per feature, in the tables' order;
    a multi-hot feature's first id), independent of where the row is in the files."""
    h = np.zeros(len(first_ids[0]), dtype=np.uint64)
    for ids in first_ids:
        h = _splitmix64(h ^ ids.astype(np.uint64))
    return h


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


def _read_training_rows(files: Sequence[str], features: Sequence[str], sizes: Sequence[int], batch_size: int,
                        sample: float = 1.0, raw_ids: bool = False, crosses: Sequence[Cross] = (),
                        count_bins: Sequence[CountBins] = ()):  # fmt: skip
    """The rows of `files` in file order (with `sample` < 1, the rows in that fraction of a
    salted id hash's range): dense [n, D], the ids (offset into one index space) with the
    row of each, labels [n], and each row's id hash (of the files' own features)."""
    offsets = np.concatenate(([0], np.cumsum(sizes[:-1]))).astype(np.int64)
    derived = {cross.name for cross in crosses} | {bins.name for bins in count_bins}
    own = [i for i, name in enumerate(features) if name not in derived]  # the files' features
    dense, ids, rows_of_ids, labels, hashes, seen = [], [], [], [], [], 0
    for batch in build_reader(files, batch_size, drop_remainder=False, prefetch=1, crosses=crosses, count_bins=count_bins):
        kjt = batch.sparse_features
        if kjt.keys() != list(features):
            kjt = kjt.permute([kjt.keys().index(name) for name in features])
        values = kjt.values().numpy()
        starts = np.concatenate(([0], np.cumsum(kjt.lengths().numpy())[:-1])).reshape(len(features), -1)
        row_hash = row_id_hash(list(values[starts[own]]))
        keep = (batch.labels != PAD_LABEL).numpy()
        if sample < 1.0:
            keep &= validation_rows(row_hash, sample, seed=SAMPLE_SALT)
        example = example_of_values(kjt).numpy()
        real = keep[example]
        dense.append(batch.dense_features.numpy()[keep])
        rows = np.remainder(values, np.repeat(np.asarray(sizes, np.int64), kjt.length_per_key())) if raw_ids else values
        ids.append((rows + np.repeat(offsets, kjt.length_per_key()))[real])
        kept_index = np.cumsum(keep) - 1  # a kept row's place among the batch's kept rows
        rows_of_ids.append((kept_index[example[real]] + seen).astype(np.int32))
        labels.append(batch.labels.numpy()[keep])
        hashes.append(row_hash[keep])
        seen += int(keep.sum())
    if not seen:
        raise ValueError("no training rows in the given files")
    cat = np.concatenate
    return cat(dense).astype(np.float64), cat(ids), cat(rows_of_ids), cat(labels).astype(np.float64), cat(hashes)


def _design(dense, column_of, rows_of_ids, labels, columns: int, rows: np.ndarray) -> _Rows:
    """The one-hot design of the selected rows over all `columns` (unseen ones stay 0)."""
    new_row = (np.cumsum(rows) - 1).astype(np.int32)  # old row → its index among the selected
    take = rows[rows_of_ids]
    r, c = new_row[rows_of_ids[take]], column_of[take]
    n = int(rows.sum())
    if len(r) >= 2**31:
        raise ValueError(f"{len(r):,} ids are too many for one in-memory design")
    ones = torch.ones(len(r), dtype=torch.float64)  # the values of both matrices
    return _Rows(torch.from_numpy(dense[rows]), _csr(r, c, n, columns, ones), _csr(c, r, columns, n, ones),
                 torch.from_numpy(labels[rows]))  # fmt: skip


def _csr(rows: np.ndarray, cols: np.ndarray, n: int, m: int, ones: torch.Tensor) -> torch.Tensor:
    """A CSR matrix of ones at (rows, cols); int32 indices (half the memory, twice as fast)."""
    order = np.argsort(rows, kind="stable")
    crow = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=n)))).astype(np.int32)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": products with a vector are all we use
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(torch.from_numpy(crow), torch.from_numpy(cols[order].astype(np.int32)), ones, (n, m))


def _lbfgs(rows: _Rows, l2: float | torch.Tensor, start: torch.Tensor, max_iter: int, tolerance: float):
    """Minimise mean log loss + l2/2‖w‖² from θ = `start`: (θ, iterations, converged). `l2`:
    one strength, or one per coordinate of θ (the bias' is not applied).

    L-BFGS runs on u = θ' / s: θ' is θ with the dense features centred (so the bias does not
    trade off against the dense weights), s the inverse square root of each coordinate's
    curvature at the click rate (a weight of an id seen once has n times less curvature than
    the bias). Same optimum, far fewer iterations.
    """
    n = len(rows.labels)
    mean = rows.dense.mean(0)
    dense = rows.dense - mean  # [n, D]
    d = dense.shape[1]
    ctr = float(rows.labels.mean())
    penalised = torch.ones_like(start)
    penalised[0] = 0.0  # the bias
    penalised = penalised * l2  # each coordinate's strength
    column_counts = torch.diff(rows.ids_t.crow_indices()).to(torch.float64)  # [m]
    curvature = torch.cat([torch.ones(1, dtype=torch.float64), (dense * dense).mean(0), column_counts / n])
    scale = (max(ctr * (1 - ctr), 0.01) * curvature + penalised).clamp_min(1e-12).rsqrt()
    centred = start.clone()
    centred[0] += mean @ start[1 : 1 + d]
    u = centred / scale

    def closure() -> torch.Tensor:
        theta = scale * u
        z = theta[0] + dense @ theta[1 : 1 + d] + rows.ids @ theta[1 + d :]  # [n]
        residual = (torch.sigmoid(z) - rows.labels) / n  # [n]
        grad = torch.cat([residual.sum().reshape(1), dense.T @ residual, rows.ids_t @ residual])
        u.grad = scale * (grad + penalised * theta)
        loss = torch.nn.functional.softplus(z).mean() - (rows.labels * z).mean()
        return loss + 0.5 * torch.sum(penalised * theta * theta)

    chunk = 10
    optimizer = torch.optim.LBFGS([u], lr=1.0, max_iter=chunk, history_size=10, tolerance_grad=1e-12,
                                  tolerance_change=1e-15, line_search_fn="strong_wolfe")  # fmt: skip
    before, converged = float(closure()), False
    while optimizer.state[u].get("n_iter", 0) < max_iter and not converged:
        optimizer.step(closure)  # `chunk` iterations, or fewer where L-BFGS finds no progress to make
        after = float(closure())
        converged = before - after <= tolerance * abs(after)
        before = after
    theta = scale * u.detach()
    theta[0] -= mean @ theta[1 : 1 + d]
    return theta, int(optimizer.state[u].get("n_iter", 0)), converged


def _predict(rows: _Rows, theta: torch.Tensor) -> np.ndarray:
    d = rows.dense.shape[1]
    return torch.sigmoid(theta[0] + rows.dense @ theta[1 : 1 + d] + rows.ids @ theta[1 + d :]).numpy()


def _both_classes(labels: torch.Tensor) -> bool:
    return len(labels) > 0 and 0.0 < float(labels.mean()) < 1.0


def _to_model(table_sizes: Mapping[str, int], theta: torch.Tensor, columns: np.ndarray,
              raw_ids: bool = False) -> HashedLogisticRegression:  # fmt: skip
    d = len(theta) - 1 - len(columns)
    model = HashedLogisticRegression(table_sizes, d, raw_ids)
    with torch.no_grad():
        model.dense.bias.fill_(float(theta[0]))
        model.dense.weight.copy_(theta[1 : 1 + d].reshape(1, -1))
        model.weights.weight[torch.from_numpy(columns), 0] = theta[1 + d :].float()
    return model.eval()
