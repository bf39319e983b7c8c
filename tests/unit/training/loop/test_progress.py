import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from evaluation.metrics import binary_state, compute_ne
from training.codec import SchemaError
from training.loop.progress import (
    HeldoutRecord,
    MetricsFollower,
    Progress,
    TrainRecord,
    metric_values,
    parse_record,
    read_records,
    record_line,
)


def test_throughput_counts_steps_not_reports(tmp_path: Path, capsys) -> None:
    progress = Progress(total_steps=100, steps_per_epoch=100, global_batch=1000, window=10**9, metrics_path=tmp_path / "m.jsonl")
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.95, 500)
    y = (rng.random(500) < p).astype(float)
    progress.add(binary_state(y, p))  # one add per logging interval of 10 steps
    time.sleep(0.05)
    record = progress.report(step=10, loss=0.5)
    progress.close()
    # 10 steps × 1000 samples in ≥ 50 ms: at most 200k samples/s, and far more than 1 step's worth.
    assert 20_000 < record.samples_per_s <= 200_000
    assert record.samples_seen == 10_000 and record.total_steps == 100
    assert record.train_window_ne == pytest.approx(compute_ne(binary_state(y, p)))
    assert read_records(tmp_path / "m.jsonl") == [record]
    assert json.loads((tmp_path / "m.jsonl").read_text())["step"] == 10
    assert "step 10/100" in capsys.readouterr().out


def test_window_drops_old_states(tmp_path: Path) -> None:
    progress = Progress(total_steps=10, steps_per_epoch=10, global_batch=100, window=100, metrics_path=None)
    good = binary_state(np.array([1.0, 0.0] * 50), np.array([0.9, 0.1] * 50))
    bad = binary_state(np.array([1.0, 0.0] * 50), np.array([0.1, 0.9] * 50))
    progress.add(bad)
    progress.add(good)
    record = progress.report(step=2, loss=0.1)
    assert record.train_window_ne == pytest.approx(compute_ne(good)), "the window holds only the last 100 samples"
    assert record.train_lifetime_ne == pytest.approx(compute_ne(bad + good))


def test_heldout_ne_is_a_typed_record_and_a_line_for_people(tmp_path: Path, capsys) -> None:
    progress = Progress(total_steps=46, steps_per_epoch=23, global_batch=256, window=100, metrics_path=tmp_path / "m.jsonl")
    progress.add_heldout(10, binary_state(np.array([1.0, 0.0]), np.array([0.8, 0.3])))
    progress.close()
    (record,) = read_records(tmp_path / "m.jsonl")
    assert isinstance(record, HeldoutRecord) and (record.step, record.total_steps, record.samples_seen) == (10, 46, 2560)
    assert record.steps_per_epoch == 23, "an epoch ends at each multiple (what early stopping reads)"
    assert "[train] step 10/46 held-out NE" in capsys.readouterr().out
    assert metric_values(record) == {"step": 10, "samples_seen": 2560, "heldout_ne": record.heldout_ne}


def _train(step: int) -> TrainRecord:
    return TrainRecord(step, 40, step * 256, 0.5, 0.9, 0.95, 1000.0, step / 10, steps_per_epoch=20)


def test_the_follower_returns_what_was_appended_since_its_last_call(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert follower.read_new() == [], "no file yet"
    with path.open("a") as file:
        file.write(record_line(_train(5)) + record_line(HeldoutRecord(10, 40, 2560, 0.9, steps_per_epoch=20)))
        file.flush()
        assert follower.read_new() == [_train(5), HeldoutRecord(10, 40, 2560, 0.9, steps_per_epoch=20)]
        assert follower.read_new() == []
        file.write(record_line(_train(10)))
        file.flush()
        assert follower.read_new() == [_train(10)]


def test_the_follower_leaves_a_partial_last_line_until_it_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    line = record_line(_train(5))
    follower = MetricsFollower(path)
    with path.open("a") as file:
        for piece in (line[:7], line[7:-1]):  # a record written in pieces, its newline last
            file.write(piece)
            file.flush()
            assert follower.read_new() == []
        file.write("\n" + record_line(_train(10))[:-1])
        file.flush()
        assert follower.read_new() == [_train(5)]
        file.write("\n")
        file.flush()
        assert follower.read_new() == [_train(10)]


def test_a_replaced_file_is_read_again_from_its_beginning(tmp_path: Path) -> None:
    """A resumed run replaces the file with the records up to its checkpoint, then appends."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(record_line(_train(s)) for s in (5, 10, 15, 20, 25)))
    follower = MetricsFollower(path)
    assert [r.step for r in follower.read_new()] == [5, 10, 15, 20, 25]
    staged = tmp_path / "staged"
    staged.write_text("".join(record_line(_train(s)) for s in (5, 10, 15, 20, 25, 30, 35)))
    staged.replace(path)  # longer than what was read: only the new inode tells
    assert [r.step for r in follower.read_new()] == [5, 10, 15, 20, 25, 30, 35]
    path.write_text(record_line(_train(5)))  # truncated in place
    assert [r.step for r in follower.read_new()] == [5]


def test_a_line_that_is_no_record_is_an_error_that_says_why(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="unknown record kind 'eval'"):
        parse_record(json.dumps({"kind": "eval", "step": 1}))
    with pytest.raises(SchemaError, match=r"HeldoutRecord is missing field\(s\) total_steps"):
        parse_record(json.dumps({"kind": "heldout", "step": 1, "samples_seen": 1, "heldout_ne": 0.9}))
    with pytest.raises(SchemaError, match="not JSON"):
        parse_record("{")


def test_nan_survives_the_file(tmp_path: Path) -> None:
    record = parse_record(record_line(HeldoutRecord(3, 9, 30, float("nan"), steps_per_epoch=20)))
    assert isinstance(record, HeldoutRecord) and math.isnan(record.heldout_ne)
