import numpy as np
import pytest

from evaluation.metrics import BinaryState, binary_state, compute_ne, summarize
from evaluation.report import Scores, build_report, report_markdown, top_slices


def _scores(seed: int, n: int = 3000) -> Scores:
    rng = np.random.default_rng(seed)
    slices = rng.choice([3, 7, 11, 42], size=n, p=[0.4, 0.3, 0.2, 0.1])
    p = np.clip(rng.beta(1, 3, n) + 0.05 * (slices == 7), 0, 1)
    y = (rng.random(n) < p).astype(np.int8)
    return Scores(y, p, slices)


def test_report_per_day_overall_and_references() -> None:
    days = {4: _scores(1), 5: _scores(2)}
    weaker = {d: Scores(s.labels, np.clip(0.5 * s.predictions + 0.12, 0, 1)) for d, s in days.items()}
    bayes = BinaryState(count=6000, label_sum=1500, cross_entropy_sum=0.5 * 6000)
    report = build_report(days, 3, reference_scores={"lr": weaker}, reference_states={"bayes": bayes})
    labels = np.concatenate([days[4].labels, days[5].labels])
    predictions = np.concatenate([days[4].predictions, days[5].predictions])
    assert report.overall == pytest.approx(summarize(labels, predictions))
    assert report.per_day[5] == pytest.approx(summarize(days[5].labels, days[5].predictions))
    lr_ne = compute_ne(binary_state(labels, np.concatenate([weaker[4].predictions, weaker[5].predictions])))
    assert report.references["lr_ne"] == pytest.approx(lr_ne)
    assert report.references["ne_gain_vs_lr_pct"] == pytest.approx(100 * (lr_ne - report.overall["ne"]) / lr_ne)
    assert report.references["bayes_ne"] == pytest.approx(compute_ne(bayes))
    flat = report.flat_metrics()
    assert {"eval_ne", "eval_ne_day_4", "eval_auc_day_5", "eval_ne_slice_rank_1", "lr_ne", "bayes_ne"} <= set(flat)


def test_slices_are_the_most_frequent_values_with_their_own_ne() -> None:
    scores = _scores(3, 20_000)
    rows = top_slices(scores, 2)
    assert [row["value"] for row in rows] == [3, 7]
    for row in rows:
        mask = scores.slices == row["value"]
        assert row["count"] == mask.sum()
        assert row["ne"] == pytest.approx(compute_ne(binary_state(scores.labels[mask], scores.predictions[mask])))


def test_slices_with_one_label_are_skipped() -> None:
    scores = Scores(np.array([1, 1, 1, 0, 1]), np.full(5, 0.5), np.array([9, 9, 9, 2, 2]))
    assert [row["value"] for row in top_slices(scores, 5)] == [2]


def test_markdown_lists_days_references_champion_and_slices() -> None:
    report = build_report({4: _scores(1)}, 2, reference_scores={"lr": {4: _scores(9)}})
    text = report_markdown(report, "Evaluation", champion_ne=0.9)
    assert "| 4 | 3,000 |" in text and "| **all** |" in text
    assert "| lr |" in text and "| current champion | 0.9000 |" in text
    assert "| slice value |" in text
