"""The pairs of features a fresh run crosses (`model.crosses = "auto"`): chosen by a score
test against the logistic-regression reference's out-of-fold predictions on the run's
training rows (ingestion/crosses.py), and kept in the run's preprocessing state, so that the
job, the served model and every night that continues it cross the same pairs.

The reference fitted here is the run's own (same rows, seed, sample and folds as the
evaluate stage's and the wide start's), read from the user's cache when it was fitted
before (training/reference_cache.py); the choice itself reads the training files' one-id
columns once more. The pairs are kept only if the regression with them predicts the
reference's held-out rows better than without (the same folds): that crossed fit is the one
a wide start then begins from. Only a reference that fitted every training row chooses
(`evaluation.reference_max_rows`): crosses are for the few rows where a regression start
matters, and a sample's predictions do not line up with the files' rows.
"""

from __future__ import annotations

import dataclasses
import time

from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from ingestion.crosses import choose_crosses
from training.reference_cache import fitted_reference


def with_chosen_crosses(config: PipelineConfig, features: Features, train_files: tuple[str, ...],
                        continues: bool = False) -> tuple[Features, str]:  # fmt: skip
    """`features` with the pairs this run crosses in its state, and what was chosen, for the
    log ("" where nothing was to choose). A run that continues a model keeps its crosses
    (the state it extends holds them); managed ids have no fixed rows to cross."""
    state = features.state
    if config.model.crosses != "auto" or continues or state.crosses:
        return features, ""
    if state.mode == "managed":
        return features, "model.crosses: no pairs crossed (managed ids give their rows as training admits them)"
    started = time.perf_counter()
    evaluation = config.evaluation
    reference = fitted_reference(state.table_sizes, train_files, seed=config.training.seed,
                                 max_rows=evaluation.reference_max_rows, folds=evaluation.reference_folds)  # fmt: skip
    fit = reference.fit
    if fit.out_of_fold is None:
        return features, f"model.crosses: no pairs crossed: the reference has no held-out predictions ({reference.how_chosen})"
    if fit.train_rows < fit.rows_available:  # its predictions are of a sample: the pairs are for few rows anyway
        return features, (f"model.crosses: no pairs crossed: the reference fitted a sample of {fit.train_rows:,} of "
                          f"{fit.rows_available:,} rows (evaluation.reference_max_rows)")  # fmt: skip
    one_id = [name for name in state.table_sizes if name not in state.multi_hot]
    crosses = choose_crosses(train_files, one_id, fit.out_of_fold, config.preprocess.hash_size)
    if not crosses:
        seconds = time.perf_counter() - started
        return features, f"model.crosses: no pair of features scored a z of 4 or more against the reference ({seconds:.1f} s)"
    # the crossed regression must predict its held-out rows better than the plain one (the same
    # folds): a pair that only passed the test by chance is shrunk, not trusted; this is also
    # the fit a wide start begins from (training/worker.py reads it back from the cache)
    tables = {**state.table_sizes, **{cross.name: cross.rows for cross in crosses}}
    with_pairs = fitted_reference(tables, train_files, seed=config.training.seed, max_rows=evaluation.reference_max_rows,
                                  folds=evaluation.reference_folds, crosses=crosses).fit  # fmt: skip
    seconds = time.perf_counter() - started
    chosen = ", ".join(f"{cross.first} × {cross.second} ({cross.rows:,} rows)" for cross in crosses)
    validated = f"held-out NE {with_pairs.validation_ne:.4f} against {fit.validation_ne:.4f} without"
    if not with_pairs.validation_ne < fit.validation_ne:
        return features, (f"model.crosses: no pairs crossed: {chosen} scored, but the regression with them did not "
                          f"predict held-out rows better ({validated}; {seconds:.1f} s)")  # fmt: skip
    crossed = dataclasses.replace(features, state=dataclasses.replace(state, crosses=crosses))
    return crossed, f"model.crosses: {len(crosses)} pair(s) crossed, strongest first: {chosen}; {validated} ({seconds:.1f} s)"
