"""The pairs of features a fresh run crosses (`model.crosses = "auto"`): chosen by a score
test against the logistic-regression reference's out-of-fold predictions on the run's
training rows (ingestion/crosses.py), and kept in the run's preprocessing state, so that the
job, the served model and every night that continues it cross the same pairs.

The reference fitted here is the run's own (same rows, sample and folds as the
evaluate stage's and the wide start's), read from the user's cache when it was fitted
before (training/reference_cache.py); the choice itself reads the training files' one-id
columns once more. A run that starts as the regression (`model.wide_start`, few rows) keeps
the pairs only if the regression with them predicts the reference's held-out rows better
than without (the same folds): that crossed fit is the one its wide part then starts from.
A larger run trusts the test (its held-out rows number tens of thousands) and spares the
second fit (79 s on the demo's 540,000 rows). Only a reference that fitted every training
row chooses (`evaluation.reference_max_rows`): a sample's predictions do not line up with
the files' rows, and reading every column of more rows than that would not fit in memory.

Then the counts a run that starts as the regression cuts into bins (`model.count_bins =
"auto"`; ingestion/count_bin_choice.py): scored against the same out-of-fold predictions,
kept only if the regression with them (and the pairs) predicts the held-out rows better than
without, and kept in the state alike.
"""

from __future__ import annotations

import dataclasses
import time

from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from flows.run.resolve import ResolvedRun
from flows.run.rows import training_rows
from ingestion.count_bin_choice import choose_count_bins
from ingestion.crosses import FAMILY_P, choose_crosses
from training.reference_cache import fitted_reference


def with_run_crosses(run: ResolvedRun, features: Features) -> tuple[Features, str]:
    """`with_chosen_crosses`, then `with_chosen_count_bins`, on the rows the resolved run trains
    on: what the pipeline, a retune and `dlrm train` cross and cut, before any trial or
    training job is built from `features` (so the tuner tunes the model the run trains)."""
    continues = run.night.warm_start is not None
    rows = training_rows(run.config, features, run.night.lineage_days, continues=continues)
    features, crossed = with_chosen_crosses(run.config, features, rows.train_files, continues=continues)
    features, binned = with_chosen_count_bins(run.config, features, rows.train_files, continues=continues)
    return features, "; ".join(line for line in (crossed, binned) if line)


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
    reference = fitted_reference(state.table_sizes, train_files, max_rows=evaluation.reference_max_rows,
                                 folds=evaluation.reference_folds)  # fmt: skip
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
        return features, (f"model.crosses: no pair of features passed the score test against the reference (a χ² tail "
                          f"of {FAMILY_P} over the pairs scored; {seconds:.1f} s)")  # fmt: skip
    chosen = ", ".join(f"{cross.first} × {cross.second} ({cross.rows:,} rows)" for cross in crosses)
    crossed_state = dataclasses.replace(state, crosses=crosses)
    validated = ""
    if config.model.wide_start == "logistic_regression":
        # a run that starts as the regression starts as the crossed one (training/worker.py reads
        # this fit back from the cache): it must predict the held-out rows better than the plain
        # one (the same folds), so that a pair that passed the test by chance is not trusted
        with_pairs = fitted_reference(crossed_state.model_table_sizes, train_files, crosses=crosses,
                                      max_rows=evaluation.reference_max_rows, folds=evaluation.reference_folds).fit  # fmt: skip
        validated = f"; the regression's held-out NE {with_pairs.validation_ne:.4f} with them, {fit.validation_ne:.4f} without"
        if not with_pairs.validation_ne < fit.validation_ne:
            seconds = time.perf_counter() - started
            return features, (f"model.crosses: no pairs crossed: {chosen} scored, but the regression with them did not "
                              f"predict held-out rows better{validated} ({seconds:.1f} s)")  # fmt: skip
    seconds = time.perf_counter() - started
    crossed = dataclasses.replace(features, state=crossed_state)
    return crossed, f"model.crosses: {len(crosses)} pair(s) crossed, strongest first: {chosen}{validated} ({seconds:.1f} s)"


def with_chosen_count_bins(config: PipelineConfig, features: Features, train_files: tuple[str, ...],
                           continues: bool = False) -> tuple[Features, str]:  # fmt: skip
    """`features` with the counts this run cuts into bins in its state (after its pairs), and
    what was chosen, for the log ("" where nothing was to choose: a run that does not start
    as the regression, one that continues a model, which keeps its bins, or one without
    dense features)."""
    state = features.state
    if (config.model.count_bins != "auto" or continues or state.count_bins or not state.dense
            or config.model.wide_start != "logistic_regression"):  # fmt: skip
        return features, ""
    if state.mode == "managed":
        return features, "model.count_bins: no counts cut (managed ids give their rows as training admits them)"
    started = time.perf_counter()
    evaluation = config.evaluation
    options = {"max_rows": evaluation.reference_max_rows, "folds": evaluation.reference_folds}
    fit = fitted_reference(state.table_sizes, train_files, **options).fit
    if fit.out_of_fold is None or fit.train_rows < fit.rows_available:
        return features, "model.count_bins: no counts cut: the reference has no held-out prediction of every training row"
    scores, chosen = choose_count_bins(train_files, state.dense, fit.out_of_fold)
    if not chosen:
        seconds = time.perf_counter() - started
        return features, (f"model.count_bins: no count's bins passed the score test against the reference (a χ² tail of "
                          f"{FAMILY_P} over the {len(scores)} counts scored; {seconds:.1f} s)")  # fmt: skip
    named = ", ".join(f"{bins.feature} ({bins.rows} bins)" for bins in chosen)
    cut_state = dataclasses.replace(state, count_bins=chosen)
    # the regression the wide part starts from, with and without the bins (the pairs in both)
    without = fitted_reference(state.model_table_sizes, train_files, crosses=state.crosses, **options).fit
    with_bins = fitted_reference(cut_state.model_table_sizes, train_files, crosses=state.crosses, count_bins=chosen,
                                 **options).fit  # fmt: skip
    seconds = time.perf_counter() - started
    validated = f"the regression's held-out NE {with_bins.validation_ne:.4f} with them, {without.validation_ne:.4f} without"
    if not with_bins.validation_ne < without.validation_ne:
        return features, (f"model.count_bins: no counts cut: {named} scored, but the regression with them did not "
                          f"predict held-out rows better; {validated} ({seconds:.1f} s)")  # fmt: skip
    return (dataclasses.replace(features, state=cut_state),
            f"model.count_bins: {len(chosen)} count(s) cut into bins: {named}; {validated} ({seconds:.1f} s)")
