"""A run resolved once: the rewrites of the configured run come in one order, each said, and
the tuning key, the job and the summary name the batch the run trains at."""

import dataclasses
from pathlib import Path

import numpy as np

from evaluation.calibration import Calibrator
from evaluation.report import EvalReport
from flows.deployments.pipeline import run_summary
from flows.run.config import load_config
from flows.run.feature_files import Features
from flows.run.job import TrainedModel, build_job
from flows.run.nights import Night, WarmStart
from flows.run.reports import IngestDay
from flows.run.resolve import resolve_run
from flows.run.rows import TrainingRows
from flows.tracking.runs import TrackedRun
from ingestion.preprocess import PreprocessState
from training.job import JobFolder, TrainSummary
from training.serving.export import ServingModel
from training.tuning.key import tuning_key
from training.tuning.trigger import TuningDecision

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"
# 12,000 training rows, as the tiny config's two days
STATE = PreprocessState("s", {"C1": 10, "C2": 5}, (0, 1), 12_000, 0.25)


def _features(config) -> Features:
    files = {day: [f"/features/day={day}/part-0.parquet"] for day in config.data.all_days}
    return Features(STATE, files, [IngestDay(day, 6000, 6000, 0, [], False) for day in config.data.all_days])


def test_a_tuned_batch_is_fitted_by_the_run_length_rule_and_the_key_job_and_summary_name_it(tmp_path: Path) -> None:
    config = load_config(TINY, [f'run_dir="{tmp_path}"'])  # nproc 2, batch 256, min_steps 20
    lookup = resolve_run(config, state=STATE)
    assert lookup.config.training.batch_size == 256 and lookup.key.global_batch_size == 256, "47 steps: kept"
    tuned = TuningDecision("use_tuned", "key was tuned", lookup.key, {"training.batch_size": 4096,
                                                                       "training.embedding_lr": 0.02})  # fmt: skip
    run = resolve_run(config, state=STATE, tuning=tuned)
    # 4,096 would train 3 steps on 12,000 rows: halved to 512 (24 steps), after the tuner's choice
    assert run.config.training.batch_size == 512 and run.steps == 24
    assert run.config.training.embedding_lr == 0.02 and config.training.batch_size == 256, "the configured config stays"
    assert [change.step for change in run.changes] == ["tuning", "run length", "tuning key"]
    assert "training.batch_size 256 → 4096" in run.changes[0].note
    assert "training at batch 512 (24 steps)" in run.changes[1].note
    assert run.key == tuning_key(run.config.training, run.workers) and run.key.global_batch_size == 512
    assert run.key != lookup.key and lookup.key.fingerprint in run.changes[-1].note
    features = _features(run.config)
    job = build_job(run.config, features, rows=TrainingRows(features.train_files(run.config.data.train_days)))
    assert job.training.batch_size == 512 and job.workers.per_rank_batch(job.training.batch_size) == 256
    # the worker writes the job's batch into its summary (training/worker.py); the run's summary reads it
    trained = TrainedModel(_summary(job.training.batch_size, job.workers.world_size), JobFolder(tmp_path))
    report = EvalReport({"ne": 0.9}, {2: {"ne": 0.9}}, [], {})
    summary = run_summary(run, _features(run.config), report, trained, TrackedRun("r", "", "1"), None, Calibrator(), 0,
                          ServingModel(tmp_path, "cpu"))  # fmt: skip
    assert summary.global_batch_size == 512 and summary.tuning_key == run.key.fingerprint
    assert summary.rows_changed is None and summary.table_rows == sum(STATE.table_sizes.values()), "a fresh model"


def test_the_champion_shape_wins_over_the_tuner_and_a_warm_start_skips_the_warm_up(tmp_path: Path) -> None:
    config = load_config(TINY, [f'run_dir="{tmp_path}"', "training.warmup_fraction=0.05"])
    champion = dataclasses.replace(config.model, embedding_dim=16, bottom_mlp=(32, 16))
    night = Night(3, (2,), WarmStart("4", "run", "/ckpt", (0, 1), champion, STATE))
    tuned = TuningDecision("use_tuned", "tuned", resolve_run(config, night, STATE).key,
                           {"model.embedding_dim": 32, "training.dense_lr": 0.01})  # fmt: skip
    run = resolve_run(config, night, STATE, tuned)
    assert run.config.model == champion and run.config.training.dense_lr == 0.01
    assert (run.config.data.train_days, run.config.data.eval_days) == ((2,), (3,))
    assert run.config.training.warmup_fraction == 0.0 and "no warm-up" in run.changes[0].note
    assert [change.step for change in run.changes][:3] == ["night", "tuning", "champion shape"]
    assert resolve_run(config, night, STATE, tuned) == run, "the same inputs resolve to the same run"


def test_a_warm_start_keeps_the_champions_preprocessing_mode_and_says_so(tmp_path: Path) -> None:
    config = load_config(TINY, [f'run_dir="{tmp_path}"', 'preprocess.categorical_mode="vocab"'])
    managed = dataclasses.replace(STATE, mode="managed")
    night = Night(3, (2,), WarmStart("4", "run", "/ckpt", (0, 1), config.model, managed))
    run = resolve_run(config, night, managed)
    assert run.config.preprocess.categorical_mode == "managed", "the champion's fitted state decides the mode"
    change = next(c for c in run.changes if c.step == "champion preprocessing")
    assert "preprocess.categorical_mode 'vocab' → 'managed'" in change.note
    same = resolve_run(dataclasses.replace(config, preprocess=run.config.preprocess), night, managed)
    assert "champion preprocessing" not in [c.step for c in same.changes], "nothing to say when the modes agree"


def test_a_fresh_run_on_auto_names_the_mode_its_state_fitted_first_and_says_why(tmp_path: Path) -> None:
    """`preprocess.categorical_mode = "auto"`: the fitted state resolved it by its rows; the run
    names that mode (the job, MLflow, the summary read it) as its first change, and the
    resolved config finds the same state (its id is the resolved mode's)."""
    config = load_config(TINY, [f'run_dir="{tmp_path}"', 'preprocess.categorical_mode="auto"'])
    vocab = dataclasses.replace(STATE, mode="vocab")
    run = resolve_run(config, state=vocab)
    assert run.config.preprocess.categorical_mode == "vocab" and config.preprocess.categorical_mode == "auto"
    assert run.changes[0].step == "preprocessing mode"
    assert 'categorical_mode "auto" → "vocab": 12,000 training rows are fewer than 32,768' in run.changes[0].note
    hashed = resolve_run(config, state=dataclasses.replace(STATE, train_rows=600_000))
    assert hashed.config.preprocess.categorical_mode == "hash" and "600,000 training rows" in hashed.changes[0].note
    full = load_config(TINY, [f'run_dir="{tmp_path}"', 'preprocess.categorical_mode="auto"', 'preprocess.table_rows="hash_size"'])
    few_but_full = resolve_run(full, state=STATE)  # 12,000 rows, hash tables asked for
    assert 'preprocess.table_rows = "hash_size"' in few_but_full.changes[0].note, few_but_full.changes[0].note
    named = resolve_run(load_config(TINY, [f'run_dir="{tmp_path}"']), state=STATE)  # tiny names "hash"
    assert "preprocessing mode" not in [change.step for change in named.changes]
    assert resolve_run(config).config.preprocess.categorical_mode == "auto", "before the state, nothing to resolve"


def test_before_the_data_is_known_only_the_night_applies(tmp_path: Path) -> None:
    config = load_config(TINY, [f'run_dir="{tmp_path}"'])
    draft = resolve_run(config, Night(2, (0, 1)))
    assert draft.steps is None and draft.config.data.eval_days == (2,) and draft.config.training == config.training


def _summary(batch: int, world: int) -> TrainSummary:
    return TrainSummary(steps=24, samples=1, seconds=1.0, samples_per_s=1.0, first_step_seconds=0.1, compiled=False,
                        precision="fp32", cpu={}, rows_trained=12_000, rows_fingerprint=int(np.uint64(7)),
                        resumed_from_step=0, world_size=world, global_batch_size=batch, device="cpu", backend="gloo",
                        pipeline="plain", checkpoint="/c", eval_rows_rank0=3000)  # fmt: skip


def test_auto_batch_sizes_are_resolved_from_the_batch_the_run_trains_at(tmp_path: Path) -> None:
    """The default search space's batches are the run's batch after the run-length rule,
    its half and its quarter; a configured list stays as written."""
    auto = load_config(TINY, [f'run_dir="{tmp_path}"', 'tuning.batch_sizes="auto"', "training.batch_size=4096"])
    assert auto.tuning.batch_sizes == "auto"
    run = resolve_run(auto, state=STATE)  # 4,096 halved to 512 for 20 steps on 12,000 rows
    assert run.config.training.batch_size == 512 and run.config.tuning.batch_sizes == (512, 256, 128)
    assert [change.step for change in run.changes] == ["run length"], "the study says what it searches"
    assert resolve_run(auto).config.tuning.batch_sizes == "auto", "not before the rows are known"
    listed = load_config(TINY, [f'run_dir="{tmp_path}"', "tuning.batch_sizes=[64, 256]"])
    assert resolve_run(listed, state=STATE).config.tuning.batch_sizes == (64, 256)


def test_few_rows_narrow_the_mlps_before_the_tuners_width_factor_and_a_warm_start_keeps_its_champions(tmp_path: Path) -> None:
    """`model.mlp_width = "auto"`: the rows size the configured MLPs first (said as a change),
    the tuner's factor then scales what the rows allow; a night keeps the champion's shape."""
    config = load_config(TINY, [f'run_dir="{tmp_path}"', "model.bottom_mlp=[512, 256, 8]", "model.top_mlp=[512, 1]"])
    run = resolve_run(config, state=STATE)  # 12,000 rows: a first layer of 128
    assert run.config.model.bottom_mlp == (128, 64, 8) and run.config.model.top_mlp == (128, 1)
    assert [change.step for change in run.changes] == ["model width"] and "12,000 training rows" in run.changes[0].note
    assert resolve_run(config).config.model == config.model, "not before the rows are known"
    tuned = TuningDecision("use_tuned", "tuned", run.key, {"model.mlp_width_factor": 2.0})
    assert resolve_run(config, state=STATE, tuning=tuned).config.model.bottom_mlp == (256, 128, 8)
    kept = load_config(TINY, [f'run_dir="{tmp_path}"', "model.bottom_mlp=[512, 256, 8]", "model.top_mlp=[512, 1]",
                              'model.mlp_width="configured"'])  # fmt: skip
    assert resolve_run(kept, state=STATE).config.model.bottom_mlp == (512, 256, 8)
    champion = dataclasses.replace(config.model, bottom_mlp=(256, 8), top_mlp=(64, 1))
    night = Night(2, (0, 1), warm_start=WarmStart("3", "r", "/c", (0, 1), champion, STATE))
    warm = resolve_run(config, night, STATE)
    assert warm.config.model == champion and "model width" not in [change.step for change in warm.changes]


def test_few_rows_start_at_the_regression_by_default_and_a_night_continuing_it_keeps_small_steps(tmp_path: Path) -> None:
    """`model.regression_start = "auto"` (the default; the tiny config sets "configured"): a
    fresh run on 12,000 rows trains a wide DLRM started as the regression, with the ceiling on
    its embedding steps, said as a change; a tuned rate applies after it; a night continuing
    that champion keeps the ceiling; a night continuing a plain champion does not get it."""
    config = load_config(TINY, [f'run_dir="{tmp_path}"', 'model.regression_start="auto"'])  # embedding_lr 0.1
    run = resolve_run(config, state=STATE)
    assert run.config.model.wide and run.config.model.wide_start == "logistic_regression"
    assert run.config.training.embedding_lr == 0.005
    assert [change.step for change in run.changes] == ["regression start"]
    assert "12,000 training rows" in run.changes[0].note and "training.embedding_lr 0.1 → 0.005" in run.changes[0].note
    assert not resolve_run(config).config.model.wide, "not before the rows are known"
    tuned = TuningDecision("use_tuned", "tuned", run.key, {"training.embedding_lr": 0.002})
    assert resolve_run(config, state=STATE, tuning=tuned).config.training.embedding_lr == 0.002
    many = PreprocessState("s", {"C1": 10, "C2": 5}, (0, 1), 68_000, 0.25)
    assert not resolve_run(config, state=many).config.model.wide
    night = Night(2, (0, 1), warm_start=WarmStart("3", "r", "/c", (0, 1), run.config.model, STATE))
    warm = resolve_run(config, night, STATE)
    assert warm.config.model == run.config.model and warm.config.training.embedding_lr == 0.005
    assert "regression start" in [change.step for change in warm.changes]
    assert resolve_run(config, night, STATE, tuned).config.training.embedding_lr == 0.002, "a tuned rate wins on a night too"
    plain = Night(2, (0, 1), warm_start=WarmStart("3", "r", "/c", (0, 1), config.model, STATE))
    assert resolve_run(config, plain, STATE).config.training.embedding_lr == 0.1
