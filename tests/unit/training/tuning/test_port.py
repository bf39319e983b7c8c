"""The port workflow's figures: the NE gap, and the time a run took to reach an NE."""

import pytest

from training.loop.progress import HeldoutRecord, TrainRecord
from training.tuning.port import PortFacts, seconds_to_reach


def train(step: int, elapsed: float) -> TrainRecord:
    return TrainRecord(step=step, total_steps=100, samples_seen=step * 10, loss=0.5, train_window_ne=0.9,
                       train_lifetime_ne=0.9, samples_per_s=1.0, elapsed_s=elapsed, steps_per_epoch=100)  # fmt: skip


def heldout(step: int, ne: float) -> HeldoutRecord:
    return HeldoutRecord(step=step, total_steps=100, samples_seen=step * 10, heldout_ne=ne, steps_per_epoch=100)


def test_the_gap_is_the_retuned_ne_less_the_nearest_keys() -> None:
    facts = PortFacts(hardware_batch_size=4096, saturated=True, characterize_run_id="r", hardware_samples_per_s=1e5,
                      nearest_key="k", nearest_batch=512, nearest_ne=0.800, retuned_ne=0.8012)  # fmt: skip
    assert facts.ne_gap == pytest.approx(0.0012)
    assert facts.ne_gap_percent == pytest.approx(0.15)
    assert facts.as_dict()["ne_gap_percent"] == pytest.approx(0.15)
    assert PortFacts(4096, True, "r", 1e5).ne_gap is None  # no tuned key elsewhere: no gap


def test_the_time_to_an_ne_is_interpolated_between_training_records() -> None:
    records = [train(10, 1.0), heldout(20, 0.95), train(20, 2.0), train(30, 4.0), heldout(25, 0.85), heldout(40, 0.8)]
    assert seconds_to_reach(records, 0.95) == pytest.approx(2.0)  # at a logged step
    assert seconds_to_reach(records, 0.90) == pytest.approx(3.0)  # step 25: halfway between 20 (2 s) and 30 (4 s)
    assert seconds_to_reach(records, 0.80) == pytest.approx(4.0)  # past the last training record: its time
    assert seconds_to_reach(records, 0.50) is None  # never reached
    assert seconds_to_reach([heldout(5, 0.7), train(10, 3.0)], 0.9) == pytest.approx(1.5)  # before the first record
