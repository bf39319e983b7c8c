"""The rule that ends a run choosing its own length, and how it says what it kept."""

import math

from training.loop.validation import EpochScores


def test_the_run_stops_after_patience_epochs_without_a_better_score() -> None:
    scores = EpochScores(patience=2, max_epochs=8)
    assert scores.add(1, 0.90) and not scores.done()
    assert scores.add(2, 0.85) and not scores.done()
    assert not scores.add(3, 0.86) and not scores.done()
    assert not scores.add(4, 0.851) and scores.done()
    assert scores.best_epochs == 2
    assert "kept epoch 2's model (the 2 after it did not improve)" in scores.reason()
    assert "2 epoch(s) without improvement" in scores.reason()


def test_max_epochs_ends_a_run_that_keeps_improving() -> None:
    scores = EpochScores(patience=2, max_epochs=3)
    for epochs, ne in ((1, 0.9), (2, 0.8), (3, 0.7)):
        assert scores.add(epochs, ne)
    assert scores.done() and scores.best_epochs == 3
    assert "max_epochs reached" in scores.reason() and "kept epoch 3's model" in scores.reason()


def test_a_continued_model_that_no_epoch_beats_is_kept() -> None:
    scores = EpochScores(patience=1, max_epochs=8)
    assert scores.add(0, 0.80)
    assert not scores.add(1, 0.81) and scores.done()
    assert scores.best_epochs == 0 and "the model it started from" in scores.reason()


def test_a_nan_score_is_never_the_best_and_ties_keep_fewer_epochs() -> None:
    scores = EpochScores(patience=3, max_epochs=8)
    scores.add(1, 0.9)
    assert not scores.add(2, math.nan) and scores.ne[2] == math.inf
    assert not scores.add(3, 0.9) and scores.best_epochs == 1


def test_a_regression_start_is_replaced_only_by_an_epoch_that_beats_it_by_the_margin() -> None:
    scores = EpochScores(patience=2, max_epochs=8, start_margin=0.005)
    assert scores.add(0, 0.80)
    assert not scores.add(1, 0.799), "0.1 % lower: within the margin, the start stays"
    assert scores.best_epochs == 0 and not scores.done()
    assert scores.add(2, 0.79) and scores.best_epochs == 2, "1.25 % lower: past it"
    assert not scores.add(3, 0.795) and not scores.add(4, 0.792) and scores.done()
    assert "kept epoch 2's model" in scores.reason()
    within = EpochScores(patience=2, max_epochs=8, start_margin=0.005)
    for epochs, ne in ((0, 0.80), (1, 0.798), (2, 0.7965)):
        within.add(epochs, ne)
    assert within.done() and within.best_epochs == 0
    assert "by more than 0.5 %" in within.reason().replace("0.5%", "0.5 %")
