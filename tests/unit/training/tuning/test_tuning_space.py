"""The search space: suggestions land in the config; tuned sets move between batch sizes."""

import itertools
import math

import optuna
import pytest

from training.config import ModelConfig, TrainingConfig
from training.tuning.config import TuningConfig
from training.tuning.space import (
    apply_params,
    clip_to_space,
    params_of,
    scale_params,
    search_batches,
    suggest,
)

SPACE = TuningConfig(batch_sizes=())  # the run's batch ("auto" is resolved with a run)


def test_suggestions_stay_in_range_and_apply_to_the_config() -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for _ in range(20):
        params = suggest(study.ask(), SPACE)
        assert SPACE.embedding_lr[0] <= params["training.embedding_lr"] <= SPACE.embedding_lr[1]
        assert SPACE.warmup_fraction[0] <= params["training.warmup_fraction"] <= SPACE.warmup_fraction[1]
        assert params["training.lr_decay"] in SPACE.lr_decay
        training, model = apply_params(TrainingConfig(), ModelConfig(), params)
        assert training.embedding_lr == params["training.embedding_lr"]
        assert training.dense_weight_decay == params["training.dense_weight_decay"]
        assert model == ModelConfig(), "no architecture search unless asked"


def test_architecture_search_keeps_the_model_valid() -> None:
    space = TuningConfig(batch_sizes=(), embedding_dims=(8, 32), mlp_width_factors=(0.5, 2.0))
    params = {**params_of(TrainingConfig(), ModelConfig(), space), "model.embedding_dim": 32,
              "model.mlp_width_factor": 0.5}  # fmt: skip
    _, model = apply_params(TrainingConfig(), ModelConfig(), params)
    assert model.embedding_dim == 32
    assert model.bottom_mlp == (256, 128, 32) and model.top_mlp == (256, 128, 1)


def test_configured_values_round_trip_through_apply() -> None:
    training = TrainingConfig(embedding_lr=0.07, dense_lr=0.002, warmup_fraction=0.05, lr_decay="cosine")
    applied, _ = apply_params(TrainingConfig(), ModelConfig(), params_of(training, ModelConfig(), SPACE))
    assert applied == training


@pytest.mark.parametrize(("rule", "factor"), [("linear", 8.0), ("sqrt", math.sqrt(8.0))])
def test_learning_rates_scale_by_the_rule_and_warmup_covers_the_same_samples(rule: str, factor: float) -> None:
    tuned = {"training.embedding_lr": 0.04, "training.dense_lr": 0.001, "training.warmup_fraction": 0.05,
             "training.lr_decay": "linear"}  # fmt: skip
    scaled = scale_params(tuned, 256, 2048, rule)
    assert scaled["training.embedding_lr"] == pytest.approx(0.04 * factor)
    assert scaled["training.dense_lr"] == pytest.approx(0.001 * factor)
    assert scaled["training.warmup_fraction"] == 0.05, "a fraction of the run covers the same samples"
    assert scaled["training.lr_decay"] == "linear"
    # a set tuned before warm-up was a fraction: its step count shrinks with the larger batch
    assert scale_params({"training.warmup_steps": 80}, 256, 2048, rule)["training.warmup_steps"] == 10


def test_warm_start_points_are_clipped_into_the_space() -> None:
    point = {"training.embedding_lr": 50.0, "training.dense_lr": 1e-9, "training.warmup_fraction": 0.9,
             "training.lr_decay": "step", "training.embedding_eps": 1e-8, "training.dense_weight_decay": 0.0,
             "model.embedding_dim": 64}  # fmt: skip
    clipped = clip_to_space(point, SPACE)
    assert clipped["training.embedding_lr"] == SPACE.embedding_lr[1]
    assert clipped["training.dense_lr"] == SPACE.dense_lr[0]
    assert clipped["training.warmup_fraction"] == SPACE.warmup_fraction[1]
    assert clipped["training.lr_decay"] == SPACE.lr_decay[0]
    assert clipped["training.dense_weight_decay"] == SPACE.dense_weight_decay[0]
    assert "model.embedding_dim" not in clipped, "not searched here, so not enqueued"


def test_bad_ranges_are_rejected_with_the_key() -> None:
    with pytest.raises(ValueError, match="embedding_lr"):
        TuningConfig(embedding_lr=(0.0, 1.0))
    with pytest.raises(ValueError, match="lr_decay"):
        TuningConfig(lr_decay=("exponential",))
    with pytest.raises(ValueError, match="seeds_per_trial"):
        TuningConfig(seeds_per_trial=0)


def test_the_dense_optimizer_is_searched_only_when_asked() -> None:
    space = TuningConfig(batch_sizes=(), dense_optimizers=("adagrad", "adam"))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    chosen = {suggest(study.ask(), space)["training.dense_optimizer"] for _ in range(20)}
    assert chosen == {"adagrad", "adam"}
    params = {**params_of(TrainingConfig(), ModelConfig(), space), "training.dense_optimizer": "adam"}
    training, _ = apply_params(TrainingConfig(dense_optimizer="adagrad"), ModelConfig(), params)
    assert training.dense_optimizer == "adam"
    assert "training.dense_optimizer" not in suggest(study.ask(), SPACE)
    # a warm start from a key tuned without the choice gets the first choice
    assert clip_to_space({"training.embedding_lr": 0.1}, space)["training.dense_optimizer"] == "adagrad"
    with pytest.raises(ValueError, match="dense_optimizers"):
        TuningConfig(dense_optimizers=("sgd",))


@pytest.mark.parametrize(("steps", "fraction", "total", "expected"),
                         [(0, 0.1, 50, 5), (20, 0.1, 50, 20), (0, 0.0, 50, 0), (100, 0.0, 30, 30), (0, 0.5, 3, 2)])
def test_warmup_is_the_longer_count_and_never_longer_than_the_run(steps: int, fraction: float, total: int,
                                                                  expected: int) -> None:  # fmt: skip
    from training.loop.schedule import lr_multiplier, warmup_length

    warmup = warmup_length(steps, fraction, total)
    assert warmup == expected
    factors = [lr_multiplier(step, total, warmup, "none", 0.0) for step in range(total)]
    assert factors[-1] == 1.0 or warmup == total, "the run reaches the full rate unless all of it is warm-up"
    assert all(a <= b for a, b in itertools.pairwise(factors))


def test_embedding_l2_is_searched_and_the_batch_size_only_when_allowed() -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    plain = suggest(study.ask(), SPACE)
    low, high = SPACE.embedding_weight_decay
    assert low <= plain["training.embedding_weight_decay"] <= high and "training.batch_size" not in plain
    space = TuningConfig(batch_sizes=(64, 128))
    chosen = {suggest(study.ask(), space)["training.batch_size"] for _ in range(12)}
    assert chosen == {64, 128}
    training, _ = apply_params(TrainingConfig(), ModelConfig(), {"training.batch_size": 64,
                                                                 "training.embedding_weight_decay": 1e-3})  # fmt: skip
    assert (training.batch_size, training.embedding_weight_decay) == (64, 1e-3)


def test_a_trials_own_epoch_choice_and_batch_size_do_not_travel_to_another_study() -> None:
    tuned = {**params_of(TrainingConfig(), ModelConfig(), TuningConfig(batch_sizes=(64, 128))),
             "training.batch_size": 64, "training.epochs": 2}  # fmt: skip
    scaled = scale_params(tuned, 128, 1024, "sqrt")
    assert "training.batch_size" not in scaled, "the set moves to the new batch"
    clipped = clip_to_space(tuned, SPACE)
    assert "training.epochs" not in clipped, "early stopping chose it; it is not a point to sample"
    assert "training.batch_size" not in clipped, "not searched in this space"
    assert clip_to_space(tuned, TuningConfig(batch_sizes=(64, 128)))["training.batch_size"] == 64


def test_auto_batch_sizes_are_the_runs_batch_its_half_and_quarter_never_below_32_a_process() -> None:
    assert search_batches(2048, 2) == (2048, 1024, 512)
    assert search_batches(128, 2) == (128, 64), "32 would be 16 rows a process"
    assert search_batches(96, 3) == (96,), "48 rows would be 16 a process"
    with pytest.raises(ValueError, match="resolved with the run"):
        suggest(optuna.create_study().ask(), TuningConfig())
