"""A run on small data gets enough optimizer steps, and says what it changed."""

import pytest

from training.config import TrainingConfig, Workers
from training.loop.run_length import fit_run_length, steps_of


def test_steps_count_the_partial_last_batch() -> None:
    assert steps_of(8000, 2048, Workers(1), 1) == 4
    assert steps_of(8000, 2048, Workers(2), 1) == 4  # 4,000 rows a rank at 1,024: 3.9 → 4
    assert steps_of(12_000, 256, Workers(2), 3) == 3 * 47
    assert steps_of(0, 256, Workers(2), 1) == 0


def test_a_small_dataset_trains_at_a_smaller_batch_and_says_so() -> None:
    fitted = fit_run_length(TrainingConfig(nproc=2, batch_size=2048), rows=8000, workers=Workers(2))
    assert fitted.training.batch_size == 128 and fitted.steps == 63
    assert "training.batch_size 2,048 would train 4 steps an epoch on 8,000 rows" in fitted.note
    assert "training at batch 128 (63 steps an epoch)" in fitted.note


def test_a_fixed_epoch_count_counts_the_steps_of_all_its_epochs() -> None:
    fitted = fit_run_length(TrainingConfig(nproc=2, batch_size=2048, epochs=2), rows=8000, workers=Workers(2))
    assert fitted.training.batch_size == 256 and fitted.steps == 2 * 32
    assert "would train 8 steps on 8,000 rows" in fitted.note and "(64 steps)" in fitted.note


def test_enough_steps_or_min_steps_off_keeps_the_batch() -> None:
    config = TrainingConfig(nproc=2, batch_size=2048)
    assert fit_run_length(config, rows=600_000, workers=Workers(2)) == fit_run_length(config, 600_000, Workers(2))
    assert fit_run_length(config, rows=600_000, workers=Workers(2)).training is config
    off = TrainingConfig(nproc=2, batch_size=2048, min_steps=0)
    kept = fit_run_length(off, rows=8000, workers=Workers(2))
    assert kept.training is off and kept.steps == 4 and kept.note is None


def test_the_batch_stops_at_32_rows_a_process_and_the_run_is_warned_about() -> None:
    fitted = fit_run_length(TrainingConfig(nproc=2, batch_size=256), rows=500, workers=Workers(2))
    assert fitted.training.batch_size == 64 and fitted.steps == 8
    assert "only 8 optimizer steps" in fitted.note and "raise training.epochs" in fitted.note


def test_min_steps_is_validated() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        TrainingConfig(min_steps=-1)


@pytest.mark.parametrize("epochs", [0, -1, "three", True, 1.5])
def test_epochs_is_auto_or_a_whole_number(epochs: object) -> None:
    with pytest.raises(ValueError, match="epochs"):
        TrainingConfig(epochs=epochs)  # type: ignore[arg-type]


def test_auto_trains_at_most_max_epochs() -> None:
    assert TrainingConfig().chooses_epochs and TrainingConfig(max_epochs=5).most_epochs == 5
    assert TrainingConfig(epochs=3, max_epochs=5).most_epochs == 3 and not TrainingConfig(epochs=3).chooses_epochs
