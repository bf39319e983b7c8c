"""The search space: what a trial suggests, how it lands in the run's config, and how a
tuned set moves to another batch size.

Parameters are named by their config key (`training.embedding_lr`), so a tuned set is
applied like `--set` overrides and reads the same in Optuna, MLflow and the config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

from training.config import ModelConfig, TrainingConfig
from training.tuning.config import TuningConfig

Params = dict[str, Any]
LEARNING_RATES = ("training.embedding_lr", "training.dense_lr")
# Parameters a trial settles itself rather than the sampler: the epoch count early stopping
# picked (kept in the trial's user attribute "chosen").
CHOSEN_BY_TRIALS = ("training.epochs",)


class Suggests(Protocol):
    """The part of `optuna.Trial` the space uses."""

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = ...) -> float: ...
    def suggest_int(self, name: str, low: int, high: int) -> int: ...
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


def suggest(trial: Suggests, space: TuningConfig) -> Params:
    """One point of the space (Optuna records each suggestion under its config key)."""
    params: Params = {
        "training.embedding_lr": trial.suggest_float("training.embedding_lr", *space.embedding_lr, log=True),
        "training.dense_lr": trial.suggest_float("training.dense_lr", *space.dense_lr, log=True),
        "training.warmup_fraction": trial.suggest_float("training.warmup_fraction", *space.warmup_fraction),
        "training.lr_decay": trial.suggest_categorical("training.lr_decay", list(space.lr_decay)),
        "training.embedding_eps": trial.suggest_float("training.embedding_eps", *space.embedding_eps, log=True),
        "training.dense_weight_decay": trial.suggest_float(
            "training.dense_weight_decay", *space.dense_weight_decay, log=True
        ),
        "training.embedding_weight_decay": trial.suggest_float(
            "training.embedding_weight_decay", *space.embedding_weight_decay, log=True
        ),
    }
    if batches := resolved_batches(space):
        params["training.batch_size"] = trial.suggest_categorical("training.batch_size", list(batches))
    if space.dense_optimizers:
        params["training.dense_optimizer"] = trial.suggest_categorical(
            "training.dense_optimizer", list(space.dense_optimizers)
        )
    if space.embedding_dims:
        params["model.embedding_dim"] = trial.suggest_categorical("model.embedding_dim", list(space.embedding_dims))
    if space.mlp_width_factors:
        params["model.mlp_width_factor"] = trial.suggest_categorical(
            "model.mlp_width_factor", list(space.mlp_width_factors)
        )
    return params


def apply_params(training: TrainingConfig, model: ModelConfig, params: Params) -> tuple[TrainingConfig, ModelConfig]:
    """The configs with a tuned set applied (validated again by the dataclasses)."""
    training_values = {k.removeprefix("training."): v for k, v in params.items() if k.startswith("training.")}
    training = dataclasses.replace(training, **training_values)
    dim = int(params.get("model.embedding_dim", model.embedding_dim))
    factor = float(params.get("model.mlp_width_factor", 1.0))
    if dim != model.embedding_dim or factor != 1.0:
        # Hidden widths scale; the bottom MLP still ends at the embedding dim, the top at 1.
        widen = lambda widths: tuple(max(1, round(w * factor)) for w in widths[:-1])
        model = dataclasses.replace(
            model, embedding_dim=dim, bottom_mlp=(*widen(model.bottom_mlp), dim), top_mlp=(*widen(model.top_mlp), 1)
        )
    return training, model


def params_of(training: TrainingConfig, model: ModelConfig, space: TuningConfig) -> Params:
    """The configured values of the searched parameters (what `off` trains with)."""
    params: Params = {
        "training.embedding_lr": training.embedding_lr,
        "training.dense_lr": training.dense_lr,
        "training.warmup_fraction": training.warmup_fraction,
        "training.lr_decay": training.lr_decay,
        "training.embedding_eps": training.embedding_eps,
        "training.dense_weight_decay": training.dense_weight_decay,
        "training.embedding_weight_decay": training.embedding_weight_decay,
    }
    if space.batch_sizes:
        params["training.batch_size"] = training.batch_size
    if space.dense_optimizers:
        params["training.dense_optimizer"] = training.dense_optimizer
    if space.embedding_dims:
        params["model.embedding_dim"] = model.embedding_dim
    if space.mlp_width_factors:
        params["model.mlp_width_factor"] = 1.0
    return params


def search_batches(batch_size: int, world_size: int) -> tuple[int, ...]:
    """`tuning.batch_sizes = "auto"`: the run's global batch, its half and its quarter,
    each a whole number of rows per process and never below 32 rows a process (the run
    length's floor), largest first (the configured batch is the first choice)."""
    floor = 32 * world_size
    choices = [batch_size]
    for divisor in (2, 4):
        smaller = batch_size // divisor
        if smaller >= floor and smaller % world_size == 0:
            choices.append(smaller)
    return tuple(choices)


def resolved_batches(space: TuningConfig) -> tuple[int, ...]:
    """The batch sizes a study searches; "auto" is resolved with the run (flows/run/resolve.py)."""
    if space.batch_sizes == "auto":
        raise ValueError("tuning.batch_sizes = \"auto\" is resolved with the run's batch before a study starts")
    return space.batch_sizes


def scale_params(params: Params, from_batch: int, to_batch: int, rule: str) -> Params:
    """Learning rates moved to another global batch size.

    `linear`: lr ∝ batch (Goyal et al., SGD); `sqrt`: lr ∝ √batch (the rule for adaptive
    optimisers such as Adagrad and Adam). A warm-up fraction covers the same samples at any
    batch; a warm-up counted in steps shrinks as the batch grows so it does too.
    """
    ratio = to_batch / from_batch
    factor = {"linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
    # the set moves to `to_batch`: a batch size the other study chose does not come along
    scaled = {name: value for name, value in params.items() if name != "training.batch_size"}
    for name in LEARNING_RATES:
        if name in scaled:
            scaled[name] = float(scaled[name]) * factor
    if "training.warmup_steps" in scaled:
        scaled["training.warmup_steps"] = round(int(scaled["training.warmup_steps"]) / ratio)
    return scaled


def clip_to_space(params: Params, space: TuningConfig) -> Params:
    """A warm-start point kept inside the search ranges (Optuna rejects points outside)."""
    bounds = {
        "training.embedding_lr": space.embedding_lr,
        "training.dense_lr": space.dense_lr,
        "training.warmup_fraction": space.warmup_fraction,
        "training.embedding_eps": space.embedding_eps,
        "training.dense_weight_decay": space.dense_weight_decay,
        "training.embedding_weight_decay": space.embedding_weight_decay,
    }
    # what a trial chose itself (its early-stopped epochs) is not a point of the space
    clipped = {name: value for name, value in params.items() if name not in CHOSEN_BY_TRIALS}
    for name, (low, high) in bounds.items():
        if name in clipped:
            value = min(max(clipped[name], low), high)
            clipped[name] = float(value)
    if clipped.get("training.lr_decay") not in space.lr_decay:
        clipped["training.lr_decay"] = space.lr_decay[0]
    for name, choices in (("training.dense_optimizer", space.dense_optimizers), ("model.embedding_dim", space.embedding_dims),
                          ("model.mlp_width_factor", space.mlp_width_factors),
                          ("training.batch_size", resolved_batches(space))):  # fmt: skip
        if choices and clipped.get(name) not in choices:
            clipped[name] = choices[0]
        if not choices:
            clipped.pop(name, None)
    return clipped
