import json
import time
from pathlib import Path

import numpy as np
import pytest

from evaluation.metrics import binary_state, compute_ne
from training.progress import Progress


def test_throughput_counts_steps_not_reports(tmp_path: Path, capsys) -> None:
    progress = Progress(total_steps=100, global_batch=1000, window=10**9, metrics_path=tmp_path / "m.jsonl")
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.95, 500)
    y = (rng.random(500) < p).astype(float)
    progress.add(binary_state(y, p))  # one add per logging interval of 10 steps
    time.sleep(0.05)
    record = progress.report(step=10, loss=0.5)
    progress.close()
    # 10 steps × 1000 samples in ≥ 50 ms: at most 200k samples/s, and far more than 1 step's worth.
    assert 20_000 < record["samples_per_s"] <= 200_000
    assert record["samples_seen"] == 10_000
    assert record["train_window_ne"] == pytest.approx(compute_ne(binary_state(y, p)))
    assert json.loads((tmp_path / "m.jsonl").read_text())["step"] == 10
    assert "step 10/100" in capsys.readouterr().out


def test_window_drops_old_states(tmp_path: Path) -> None:
    progress = Progress(total_steps=10, global_batch=100, window=100, metrics_path=None)
    good = binary_state(np.array([1.0, 0.0] * 50), np.array([0.9, 0.1] * 50))
    bad = binary_state(np.array([1.0, 0.0] * 50), np.array([0.1, 0.9] * 50))
    progress.add(bad)
    progress.add(good)
    record = progress.report(step=2, loss=0.1)
    assert record["train_window_ne"] == pytest.approx(compute_ne(good)), "the window holds only the last 100 samples"
    assert record["train_lifetime_ne"] == pytest.approx(compute_ne(bad + good))
