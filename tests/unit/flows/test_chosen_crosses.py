"""flows/run/crosses.py: which runs choose pairs to cross (`model.crosses`) and counts to cut
into bins (`model.count_bins`), what they choose on the tiny days' features, and that the job
and a night continuing it carry them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.run.config import PipelineConfig, load_config
from flows.run.crosses import with_chosen_count_bins, with_chosen_crosses
from flows.run.feature_files import Features
from flows.run.job import build_job
from ingestion.count_bins import CountBins
from ingestion.cross_ids import Cross
from ingestion.synthetic import GroundTruth
from tests.conftest import TINY_SYNTHETIC

TINY = Path(__file__).parents[3] / "configs" / "tiny.toml"


def _config(tmp_path: Path, *overrides: str) -> PipelineConfig:
    return load_config(TINY, [f'run_dir="{tmp_path}"', *overrides])


def _features(tiny_features) -> tuple[Features, tuple[str, ...]]:
    state, files = tiny_features
    return Features(state, files, []), (*files[0], *files[1])


def test_only_a_fresh_run_asking_for_them_chooses_crosses(tiny_features, tmp_path: Path) -> None:
    """`none` and a run continuing a model leave the features as they are, with nothing said;
    managed ids say why they cross nothing; a state that holds crosses keeps them."""
    features, train_files = _features(tiny_features)
    assert _config(tmp_path).model.crosses == "auto", "the default"
    assert with_chosen_crosses(_config(tmp_path, 'model.crosses="none"'), features, train_files) == (features, "")
    auto = _config(tmp_path, 'model.crosses="auto"')
    assert with_chosen_crosses(auto, features, train_files, continues=True) == (features, "")
    managed = dataclasses.replace(features, state=dataclasses.replace(features.state, mode="managed"))
    kept, note = with_chosen_crosses(auto, managed, train_files)
    assert kept is managed and "managed ids" in note
    held = dataclasses.replace(features, state=dataclasses.replace(features.state, crosses=(Cross("C1", "C2", 9),)))
    assert with_chosen_crosses(auto, held, train_files) == (held, "")


@pytest.mark.slow  # a 5-fold cross-validated fit: seconds alone, far more beside another test process's fit
def test_the_tiny_days_cross_the_generators_pairs_and_the_job_carries_them(tiny_features, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Against the reference's out-of-fold predictions (5 folds, the default on few rows),
    every pair chosen is one the generator makes interact (the six of bench/chosen_crosses.py);
    each becomes a table of the job, after the features' own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    features, train_files = _features(tiny_features)
    config = _config(tmp_path, 'model.crosses="auto"', "evaluation.reference_folds=0")
    crossed, note = with_chosen_crosses(config, features, train_files)
    crosses = crossed.state.crosses
    generators = {frozenset((f"C{a + 1}", f"C{b + 1}")) for a, b in GroundTruth(TINY_SYNTHETIC).pairs}
    print(note)
    assert all(frozenset((c.first, c.second)) in generators for c in crosses), (note, generators)
    assert {(c.first, c.second) for c in crosses} == {("C18", "C19"), ("C6", "C11"), ("C22", "C25"), ("C6", "C21"),
                                                      ("C3", "C23"), ("C7", "C14")}  # fmt: skip
    assert note.startswith(f"model.crosses: {len(crosses)} pair(s) crossed")
    assert all(2 <= c.rows <= config.preprocess.hash_size for c in crosses)
    assert crossed.state.state_id == features.state.state_id, "the feature files are the same"
    job = build_job(config, crossed)
    assert job.crosses == crosses
    assert list(job.table_sizes) == [*features.state.table_sizes, *(c.name for c in crosses)]
    again, _ = with_chosen_crosses(config, features, train_files)  # the reference read back from the cache
    assert build_job(config, again) == job, "the same choice, the same job (a rerun resumes it)"
    # a run that starts as the regression keeps them only as the crossed regression predicts better
    started = _config(tmp_path, 'model.crosses="auto"', "evaluation.reference_folds=0", "model.wide=true",
                      'model.wide_start="logistic_regression"')  # fmt: skip
    kept, note = with_chosen_crosses(started, features, train_files)
    print(note)
    assert kept.state.crosses == crosses and "the regression's held-out NE" in note
    with_them, without = (float(word.rstrip(",")) for word in note.split("held-out NE ")[1].split()[:4:3])
    assert with_them < without * 0.98, note


def test_a_slice_of_few_held_out_rows_crosses_nothing(tiny_features, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny.toml's reference validates on one 10 % slice: 1,200 rows, too few to tell a pair
    from chance over the pairs scored, so nothing is crossed, and the log says so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    features, train_files = _features(tiny_features)
    crossed, note = with_chosen_crosses(_config(tmp_path, 'model.crosses="auto"'), features, train_files)
    assert crossed == features and note.startswith("model.crosses: no pair of features passed the score test")


def _starting_as_the_regression(tmp_path: Path, *overrides: str) -> PipelineConfig:
    return _config(tmp_path, "evaluation.reference_folds=0", "model.wide=true", 'model.wide_start="logistic_regression"',
                   *overrides)  # fmt: skip


def test_only_a_fresh_run_that_starts_as_the_regression_cuts_counts(tiny_features, tmp_path: Path) -> None:
    """`none`, a run that does not start as the regression (its bottom MLP learns each count's
    shape), one continuing a model and a state that holds bins leave the features as they
    are, with nothing said; managed ids say why they cut nothing."""
    features, train_files = _features(tiny_features)
    started = _starting_as_the_regression(tmp_path)
    assert started.model.count_bins == "auto", "the default"
    assert with_chosen_count_bins(_config(tmp_path), features, train_files) == (features, "")
    assert with_chosen_count_bins(_starting_as_the_regression(tmp_path, 'model.count_bins="none"'), features,
                                  train_files) == (features, "")  # fmt: skip
    assert with_chosen_count_bins(started, features, train_files, continues=True) == (features, "")
    held = dataclasses.replace(features, state=dataclasses.replace(features.state, count_bins=(CountBins("I1", (1.0,)),)))
    assert with_chosen_count_bins(started, held, train_files) == (held, "")
    managed = dataclasses.replace(features, state=dataclasses.replace(features.state, mode="managed"))
    kept, note = with_chosen_count_bins(started, managed, train_files)
    assert kept is managed and "managed ids" in note


def _bent_in_i6(train_files: tuple[str, ...], folder: Path) -> tuple[str, ...]:
    """The tiny training files with labels drawn anew from a bend in I6 (highest midway) and
    the straight line of I1: the generator's own counts are straight lines in ln(1 + x)."""
    folder.mkdir()
    rng, written = np.random.default_rng(7), []
    for number, path in enumerate(train_files):
        table = pq.read_table(path)
        i6, i1 = (table.column(name).to_numpy().astype(np.float64) for name in ("I6", "I1"))
        logit = -0.5 + 0.3 * i1 - 0.5 * (i6 - 2.0) ** 2
        labels = (rng.random(len(i6)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
        out = folder / f"part-{number}.parquet"
        pq.write_table(table.set_column(0, table.schema.field(0), pa.array(labels, type=table.schema.field(0).type)), out)
        written.append(str(out))
    return tuple(written)


@pytest.mark.slow  # the reference's 2-fold fits, three times
def test_a_bent_count_is_cut_and_the_straight_ones_are_not_and_the_job_carries_its_bins(
        tiny_features, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the tiny days' generated labels (every count a straight line) no count is cut; with
    labels bent in I6, I6 is, none of the eleven counts the labels ignore is, the regression
    with the bins predicts the held-out rows better, and the job reads them as tables after
    the features' own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    state, files = tiny_features
    day_0 = tuple(files[0])
    started = _starting_as_the_regression(tmp_path, 'model.crosses="none"', "evaluation.reference_folds=2")
    kept, note = with_chosen_count_bins(started, Features(state, {0: list(day_0)}, []), day_0)
    assert kept.state == state and note.startswith("model.count_bins: no count's bins passed the score test"), note
    assert "over the 13 counts scored" in note
    bent = _bent_in_i6(day_0, tmp_path / "bent")
    cut, note = with_chosen_count_bins(started, Features(state, {0: list(bent)}, []), bent)
    print(note)
    chosen = [bins.feature for bins in cut.state.count_bins]
    assert "I6" in chosen and set(chosen) <= {"I1", "I6"}, note
    assert note.startswith(f"model.count_bins: {len(chosen)} count(s) cut into bins: ")
    with_them, without = (float(word.rstrip(",;")) for word in note.split("held-out NE ")[1].split()[:4:3])
    assert with_them < without * 0.98, note
    job = build_job(started, dataclasses.replace(_features(tiny_features)[0], state=cut.state))  # the tiny days' files
    assert job.count_bins == cut.state.count_bins
    assert list(job.table_sizes)[-len(chosen):] == [f"{name}_bins" for name in chosen]
    assert job.table_sizes["I6_bins"] == len(cut.state.count_bins[chosen.index("I6")].edges) + 1 >= 16
