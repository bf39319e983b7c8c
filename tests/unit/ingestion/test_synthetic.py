import gzip
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from evaluation.metrics import binary_state, compute_ne
from ingestion.config import SyntheticConfig
from ingestion.synthetic import GroundTruth, generate_chunk, generate_day, shared_ground_truth

HEX8 = re.compile(r"^[0-9a-f]{8}$")
INTEGER = re.compile(r"^-?[0-9]+$")


def _lines(path: Path) -> list[list[str]]:
    with gzip.open(path, "rt") as handle:
        return [line.rstrip("\n").split("\t") for line in handle]


def test_files_follow_the_criteo_layout(tiny_raw: Path) -> None:
    rows = _lines(tiny_raw / "day_0.tsv.gz")
    assert len(rows) == 6000
    for fields in rows:
        assert len(fields) == 40
        assert fields[0] in ("0", "1")
        assert all(v == "" or INTEGER.match(v) for v in fields[1:14])
        assert all(v == "" or HEX8.match(v) for v in fields[14:])


def test_statistics_are_criteo_like(tiny_raw: Path) -> None:
    rows = _lines(tiny_raw / "day_1.tsv.gz")
    labels = np.array([int(f[0]) for f in rows])
    dense_empty = np.mean([v == "" for f in rows for v in f[1:14]])
    sparse_empty = np.mean([v == "" for f in rows for v in f[14:]])
    negatives = sum(v.startswith("-") for f in rows for v in f[1:14])
    assert 0.2 < labels.mean() < 0.3
    assert 0.1 < dense_empty < 0.3
    assert 0.04 < sparse_empty < 0.2
    assert negatives > 0, "dense counts can be negative, as in real logs"
    stats = json.loads((tiny_raw / "day_1.stats.json").read_text())
    assert stats["rows"] == 6000 and stats["clicks"] == labels.sum()
    assert abs(stats["dense_empty_fraction"] - dense_empty) < 1e-9


def test_value_frequencies_follow_a_power_law() -> None:
    config = SyntheticConfig(rows_per_day=1000, seed=3, cardinality_scale=0.05)
    truth = GroundTruth(config)
    ranks = truth.sample_ranks(np.random.default_rng(0), 200_000)
    feature = int(np.argmax(truth.cardinality))  # millions of values at full scale
    counts = np.sort(np.bincount(ranks[ranks[:, feature] >= 0, feature]))[::-1]
    top_share = counts[:100].sum() / counts.sum()
    assert truth.cardinality.min() >= 3 and truth.cardinality.max() > 100_000
    assert top_share > 0.2, "a few head values take a large share, as in real logs"
    assert (counts == 1).sum() > 1000, "and a long tail of values is seen once"


def test_same_seed_same_bytes_other_seed_other_data(tmp_path: Path) -> None:
    config = SyntheticConfig(rows_per_day=3000, seed=5, cardinality_scale=0.001)
    generate_day(config, 0, tmp_path / "a")
    generate_day(config, 0, tmp_path / "b")
    generate_day(SyntheticConfig(rows_per_day=3000, seed=6, cardinality_scale=0.001), 0, tmp_path / "c")
    def read(path: Path) -> bytes:
        with gzip.open(path) as handle:
            return handle.read()

    assert read(tmp_path / "a/day_0.tsv.gz") == read(tmp_path / "b/day_0.tsv.gz")
    assert read(tmp_path / "a/day_0.tsv.gz") != read(tmp_path / "c/day_0.tsv.gz")


def test_bayes_ne_is_the_ne_of_the_true_probabilities() -> None:
    config = SyntheticConfig(rows_per_day=1000, seed=9, cardinality_scale=0.01)
    truth = GroundTruth(config)
    table, probability = generate_chunk(truth, np.random.default_rng([9, 0]), 50_000)
    labels = table["label"].to_numpy()
    true_ne = compute_ne(binary_state(labels, probability))
    assert true_ne < 0.9, "the labels carry a learnable signal"
    # The true probabilities beat any other predictor in expectation, e.g. a shrunk version.
    shrunk = 0.5 * probability + 0.5 * labels.mean()
    assert compute_ne(binary_state(labels, shrunk)) > true_ne


def test_written_bayes_ne_matches_recomputation(tmp_path: Path) -> None:
    config = SyntheticConfig(rows_per_day=5000, seed=4, cardinality_scale=0.001)
    truth = GroundTruth(config)
    stats = generate_day(config, 2, tmp_path, truth)
    table, probability = generate_chunk(truth, np.random.default_rng([4, 2]), 5000)
    assert np.isclose(stats.bayes_ne, compute_ne(binary_state(table["label"].to_numpy(), probability)), rtol=1e-9)


def test_days_are_reused_only_when_written_with_the_same_settings(tmp_path: Path) -> None:
    from dataclasses import replace

    from ingestion.synthetic import existing_day

    config = SyntheticConfig(rows_per_day=2000, seed=5, cardinality_scale=0.001)
    generate_day(config, 0, tmp_path)
    assert existing_day(config, tmp_path, 0) is not None
    assert existing_day(replace(config, seed=6), tmp_path, 0) is None
    assert existing_day(replace(config, rows_per_day=2001), tmp_path, 0) is None
    (tmp_path / "day_0.tsv.gz").unlink()
    assert existing_day(config, tmp_path, 0) is None


# Written by the generator before `signal_scale` existed (sha256 of the uncompressed day).
DEFAULT_DAY_SHA256 = "49ca891bbeb9fc25cd2bc5efabf7d58ac03214779f58bbde21b5d15496a5cc7a"
MULTI_HOT_DAY_SHA256 = "68dcf61feadf01a4f1ee0288107b09edb079aea6afa3169f56da593de0fa63d4"
SMALL_REAL = Path(__file__).resolve().parents[3] / "configs" / "small-real.toml"


def test_the_default_generator_is_unchanged(tmp_path: Path) -> None:
    import hashlib

    from ingestion.synthetic import generator_fingerprint

    config = SyntheticConfig(rows_per_day=3000)
    multi_hot = SyntheticConfig(rows_per_day=2000, seed=12, cardinality_scale=0.001, multi_hot_mean_ids=4.0)
    plain = generate_day(config, 1, tmp_path / "a")
    bags = generate_day(multi_hot, 1, tmp_path / "b", GroundTruth(multi_hot, ("C3", "C12")))
    with gzip.open(tmp_path / "a/day_1.tsv.gz") as a, gzip.open(tmp_path / "b/day_1.tsv.gz") as b:
        assert hashlib.sha256(a.read()).hexdigest() == DEFAULT_DAY_SHA256
        assert hashlib.sha256(b.read()).hexdigest() == MULTI_HOT_DAY_SHA256
    assert plain.bayes_ne == 0.6529938120137487 and bags.bayes_ne == 0.6329802654733798
    # days written before the new setting keep their fingerprint, so they are still reused
    assert generator_fingerprint(config) == ('v2:{"cardinality_scale": 0.05, "click_rate": 0.25, '
                                             '"multi_hot_mean_ids": 8.0, "rows_per_day": 3000, "seed": 7}')  # fmt: skip
    assert "signal_scale" in generator_fingerprint(SyntheticConfig(rows_per_day=3000, signal_scale=0.5))


def test_signal_scale_weakens_the_signal_and_keeps_the_rows_and_click_rate() -> None:
    def chunk(signal_scale: float):
        truth = GroundTruth(SyntheticConfig(rows_per_day=1000, seed=9, signal_scale=signal_scale))
        table, probability = generate_chunk(truth, np.random.default_rng([9, 0]), 20_000)
        return table, probability, compute_ne(binary_state(table["label"].to_numpy(), probability))

    strong, weak, none = chunk(1.0), chunk(0.5), chunk(0.0)
    assert strong[0].drop_columns(["label"]).equals(weak[0].drop_columns(["label"])), "the same ids and counts"
    assert abs(weak[1].mean() - strong[1].mean()) < 0.01 and abs(none[1].mean() - 0.25) < 0.01
    assert strong[2] < 0.75 and 0.8 < weak[2] < 0.9
    assert np.ptp(none[1]) < 1e-12 and none[2] > 0.99, "no signal: every row has the click rate"
    with pytest.raises(ValueError, match="signal_scale"):
        SyntheticConfig(signal_scale=-0.1)


def test_small_real_days_are_small_weak_and_heavy_tailed() -> None:
    import tomllib

    import pyarrow.compute as pc

    from ingestion.schema import SPARSE_COLUMNS

    settings = tomllib.loads(SMALL_REAL.read_text())["data"]["synthetic"]
    config = SyntheticConfig(**settings)
    assert 2_000 <= config.rows_per_day <= 10_000
    truth = GroundTruth(config)
    for day in (0, 1):
        table, probability = generate_chunk(truth, np.random.default_rng([config.seed, day]), config.rows_per_day)
        labels = table["label"].to_numpy()
        assert 0.85 <= compute_ne(binary_state(labels, probability)) <= 0.9, "Bayes-optimal NE like real logs"
        assert 0.2 < labels.mean() < 0.3
        counts = np.concatenate([pc.value_counts(table[c].drop_null()).field("counts").to_numpy() for c in SPARSE_COLUMNS])
        assert np.mean(counts == 1) > 0.5, "most ids are seen once"


def test_a_drifting_signal_turns_by_the_configured_angle_a_day() -> None:
    """Logits of the same rows on days 0 and k: each effect correlates by cos(k × drift),
    the pairwise terms (products of two) by its square, so the logits lie between; without
    drift the days are the same ground truth exactly."""
    config = SyntheticConfig(cardinality_scale=0.01, signal_drift=0.5)
    truth, still = GroundTruth(config), GroundTruth(SyntheticConfig(cardinality_scale=0.01))
    rng = np.random.default_rng(3)
    ranks, dense = truth.sample_ranks(rng, 40_000), truth.sample_dense(rng, 40_000)
    assert np.array_equal(still.logits(ranks, dense, day=0), still.logits(ranks, dense, day=5))
    assert np.array_equal(truth.logits(ranks, dense, day=0), still.logits(ranks, dense, day=0)), "day 0: as before"
    base = truth.logits(ranks, dense, day=0) - truth.bias
    for days in (1, 2):
        turned = truth.logits(ranks, dense, day=days) - truth.bias
        correlation, cos = float(np.corrcoef(base, turned)[0, 1]), np.cos(0.5 * days)
        assert cos**2 - 0.03 < correlation < cos + 0.03, (days, correlation)
        assert abs(turned.std() / base.std() - 1) < 0.1, "a turn keeps the signal's strength"


def test_ids_live_their_lifetime_then_give_way_to_new_ones() -> None:
    """With id_lifetime_days = 4, each day about a quarter of a feature's values is logged
    under a new id; an id never comes back once replaced; without it ids never change."""
    truth = GroundTruth(SyntheticConfig(cardinality_scale=0.05, id_lifetime_days=4))
    ranks = np.arange(20_000)
    feature = 2
    by_day = [truth.hex_ids(ranks, feature, day) for day in range(9)]
    for day in range(1, 9):
        changed = float(np.mean(by_day[day] != by_day[day - 1]))
        assert 0.2 < changed < 0.3, (day, changed)
    # a value's id over the days: runs of at most 4 days, never an earlier id again
    per_value = np.stack(by_day, axis=1)  # [values, days]
    for row in per_value[:200]:
        runs = [len(list(group)) for _, group in __import__("itertools").groupby(row)]
        assert max(runs) <= 4 and len(set(row.tolist())) == len(runs)
    forever = GroundTruth(SyntheticConfig(cardinality_scale=0.05))
    assert np.array_equal(forever.hex_ids(ranks, feature, 0), forever.hex_ids(ranks, feature, 8))
    small = 8  # C9, 3 values: a feature this small (a device, a country) keeps its ids
    assert truth.cardinality[small] < 1_000 <= truth.cardinality[feature]
    assert np.array_equal(truth.hex_ids(ranks[:3], small, 0), truth.hex_ids(ranks[:3], small, 8))


def test_the_shared_ground_truth_is_built_once_and_is_the_one_a_fresh_build_gives() -> None:
    config = SyntheticConfig(rows_per_day=100, seed=5, cardinality_scale=0.001)
    shared = shared_ground_truth(config, ())
    assert shared_ground_truth(config, ()) is shared, "one build per process"
    fresh = GroundTruth(config)
    assert shared.bias == fresh.bias and np.array_equal(shared.normals, fresh.normals)
    assert shared_ground_truth(config, ("C3",)).multi_hot == ("C3",), "another multi-hot set is another truth"


def test_a_kept_bias_builds_the_same_ground_truth_without_the_pilot(tmp_path: Path, monkeypatch) -> None:
    config = SyntheticConfig(rows_per_day=500, seed=13, cardinality_scale=0.001)
    calibrated = shared_ground_truth(config, (), kept_in=tmp_path / "kept")
    [entry] = (tmp_path / "kept").glob("*.json")
    assert json.loads(entry.read_text())["bias"] == calibrated.bias == GroundTruth(config).bias
    shared_ground_truth.cache_clear()  # as the next process
    monkeypatch.setattr(GroundTruth, "_calibrate_bias", lambda self, click_rate: pytest.fail("the pilot ran again"))
    kept = shared_ground_truth(config, (), kept_in=tmp_path / "kept")
    assert kept.bias == calibrated.bias
    generate_day(config, 0, tmp_path / "calibrated", calibrated)
    generate_day(config, 0, tmp_path / "kept-bias", kept)
    assert _lines(tmp_path / "calibrated" / "day_0.tsv.gz") == _lines(tmp_path / "kept-bias" / "day_0.tsv.gz")
    with pytest.raises(pytest.fail.Exception, match="the pilot ran again"):
        shared_ground_truth(replace(config, seed=14), (), kept_in=tmp_path / "kept")  # another config: its own pilot


def test_an_unreadable_kept_bias_is_calibrated_again_and_replaced(tmp_path: Path) -> None:
    config = SyntheticConfig(rows_per_day=500, seed=15, cardinality_scale=0.001)
    calibrated = shared_ground_truth(config, ("C3",), kept_in=tmp_path)
    [entry] = tmp_path.glob("*.json")
    entry.write_text('{"bias": "not a number"')
    shared_ground_truth.cache_clear()
    again = shared_ground_truth(config, ("C3",), kept_in=tmp_path)
    assert again.bias == calibrated.bias and json.loads(entry.read_text())["bias"] == calibrated.bias
    assert [path.name for path in tmp_path.iterdir()] == [entry.name], "published whole, nothing staged left"
