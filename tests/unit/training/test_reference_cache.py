"""The fitted reference is kept by what it was fitted on: the same bytes in another folder are
read back (the same weights and figures as a fresh fit), anything that changes the fit fits
again, a torn entry is fitted again and replaced, and only the newest entries stay."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ingestion.schema import DENSE_COLUMNS, NUM_DENSE, SPARSE_COLUMNS
from training.reference import fit_logistic_regression
from training.reference_cache import fitted_reference

SIZES = {name: 1 for name in SPARSE_COLUMNS} | {"C1": 5, "C2": 40, "C3": 200}


def _features(folder: Path, seed: int, rows: int = 800) -> list[str]:
    """Feature Parquet as preprocessing writes it, with a signal on three categoricals."""
    rng = np.random.default_rng(seed)
    columns = {name: np.zeros(rows, np.int32) for name in SPARSE_COLUMNS}
    z = np.full(rows, -1.2)
    for name in ("C1", "C2", "C3"):
        columns[name] = rng.integers(1, SIZES[name], rows).astype(np.int32)
        z += rng.normal(0, 0.6, SIZES[name])[columns[name]]
    dense = np.log1p(rng.exponential(5.0, (rows, NUM_DENSE))).astype(np.float32)
    columns["label"] = (rng.random(rows) < 1 / (1 + np.exp(-z))).astype(np.int8)
    columns |= {name: dense[:, i] for i, name in enumerate(DENSE_COLUMNS)}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "part-0.parquet"
    pq.write_table(pa.table({name: columns[name] for name in ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)}), path)
    return [str(path)]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_the_same_rows_in_another_folder_are_read_back_as_a_fresh_fit_gives_them(tmp_path: Path, cache: Path) -> None:
    first = fitted_reference(SIZES, _features(tmp_path / "a", seed=1), seed=2, cache=cache)
    again = fitted_reference(SIZES, _features(tmp_path / "b", seed=1), seed=2, cache=cache)
    fresh = fit_logistic_regression(SIZES, _features(tmp_path / "c", seed=1), seed=2)  # 5 folds, as by default
    assert not first.reused and again.reused
    assert _same_weights(again.fit.model, fresh.model)
    assert again.fit.validation_ne_by_c == fresh.validation_ne_by_c and again.fit.c == fresh.c
    assert (again.fit.train_rows, again.fit.folds, again.fit.converged) == (fresh.train_rows, fresh.folds, fresh.converged)
    assert again.how_chosen == fresh.how_chosen + " (the same rows' fit, reused)"
    assert np.array_equal(again.fit.out_of_fold, fresh.out_of_fold) and np.isfinite(fresh.out_of_fold).all()


def test_one_held_out_slice_predicts_only_its_own_rows_and_is_kept_so(tmp_path: Path, cache: Path) -> None:
    """With one held-out slice (folds = 1) only its rows have a prediction by a fit that did
    not see them; the others are NaN, in the fit and in the entry read back."""
    files = _features(tmp_path / "a", seed=3, rows=2_000)
    fresh = fitted_reference(SIZES, files, seed=2, folds=1, cache=cache)
    again = fitted_reference(SIZES, files, seed=2, folds=1, cache=cache)
    assert not fresh.reused and again.reused and fresh.fit.folds == 1
    scored = np.isfinite(fresh.fit.out_of_fold)
    assert scored.sum() == fresh.fit.validation_rows and 0 < scored.sum() < fresh.fit.train_rows
    assert np.array_equal(again.fit.out_of_fold, fresh.fit.out_of_fold, equal_nan=True)
    assert ((fresh.fit.out_of_fold[scored] > 0) & (fresh.fit.out_of_fold[scored] < 1)).all()


def test_other_rows_or_options_fit_again(tmp_path: Path, cache: Path) -> None:
    files = _features(tmp_path / "a", seed=1)
    assert not fitted_reference(SIZES, files, seed=2, folds=2, cache=cache).reused
    other_rows = _features(tmp_path / "b", seed=5)
    for changed in ({"seed": 3, "folds": 2}, {"seed": 2, "folds": 3}, {"seed": 2, "folds": 2, "max_rows": 500}):
        assert not fitted_reference(SIZES, files, cache=cache, **changed).reused, changed
    assert not fitted_reference(SIZES, other_rows, seed=2, folds=2, cache=cache).reused
    assert not fitted_reference(SIZES | {"C3": 250}, files, seed=2, folds=2, cache=cache).reused
    assert fitted_reference(SIZES, files, seed=2, folds=3, cache=cache).reused


def test_a_torn_entry_is_fitted_again_and_replaced(tmp_path: Path, cache: Path) -> None:
    files = _features(tmp_path / "a", seed=1)
    first = fitted_reference(SIZES, files, seed=2, folds=2, cache=cache)
    (entry,) = cache.glob("*.pt")
    entry.write_bytes(entry.read_bytes()[:100])
    refit = fitted_reference(SIZES, files, seed=2, folds=2, cache=cache)
    assert not refit.reused and _same_weights(refit.fit.model, first.fit.model)
    assert fitted_reference(SIZES, files, seed=2, folds=2, cache=cache).reused


def test_only_the_newest_entries_stay(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("training.reference_cache.KEPT_ENTRIES", 2)
    files = _features(tmp_path / "a", seed=1, rows=400)
    for seed in range(3):
        fitted_reference(SIZES, files, seed=seed, folds=2, cache=cache)
    assert len(list(cache.glob("*.pt"))) == 2
    assert not fitted_reference(SIZES, files, seed=0, folds=2, cache=cache).reused, "the oldest was removed"
    assert fitted_reference(SIZES, files, seed=2, folds=2, cache=cache).reused


def test_a_cache_that_cannot_be_written_still_fits(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    fit = fitted_reference(SIZES, _features(tmp_path / "a", seed=1, rows=400), seed=2, folds=2, cache=blocked)
    assert not fit.reused and fit.fit.converged and blocked.is_file()
