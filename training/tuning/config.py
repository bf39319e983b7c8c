"""The `[tuning]` section: when to retune, how to search, and where studies live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ingestion.days import DayError, parse_day

Policy = Literal["retune_first", "scale_and_schedule", "characterize_then_retune", "off"]
LR_DECAYS = ("none", "linear", "cosine")


@dataclass(frozen=True)
class TuningConfig:
    """Hyperparameter retuning for a run whose tuning key was never tuned.

    `policy`: `retune_first` runs the retune flow before training and trains with its
    result; `scale_and_schedule` trains now with the nearest tuned key's parameters,
    learning rates scaled by `scaling_rule`, and schedules a retune; `characterize_then_retune`
    (the port workflow, `dlrm port`), on hardware no key was tuned on: measures the batch
    size where this hardware's throughput saturates (`dlrm characterize`), retunes at that
    batch, and trains with both (on known hardware: as `retune_first`); `off` trains with the
    configured values. A key that was tuned always trains with its best parameters.
    """

    policy: Policy = "scale_and_schedule"
    """for a tuning key never tuned: `scale_and_schedule` trains now with the nearest tuned key's best (learning rates scaled)
    and schedules a retune; `retune_first` retunes before training; `characterize_then_retune` (the port workflow, `dlrm
    port`), on hardware no key was tuned on: measures the batch where throughput saturates, retunes at it, trains at it (on
    known hardware: as `retune_first`; [characterize.md](characterize.md)); `off` trains with the configured values. A tuned
    key always trains with its best"""
    # Optuna storage; empty means SQLite in the run directory. A postgresql:// URL lets
    # workers on several hosts join one study.
    storage: str = ""
    """Optuna storage; empty: SQLite at `<run_dir>/optuna.db`. A `postgresql://` URL lets workers on several hosts join
    one study"""
    # "tpe": multivariate TPE, which learns from pruned trials too; "gp": a Gaussian process,
    # which sees finished trials only (use it with few pruned trials).
    sampler: Literal["gp", "tpe"] = "tpe"
    """`tpe`: multivariate TPE, which learns from pruned trials too; `gp`: a Gaussian process, which sees finished trials only
    (pair it with few pruned trials)"""
    pruner: Literal["median", "hyperband", "none"] = "median"
    """`median`, `hyperband` or `none`, fed by held-out NE during training"""
    # No trial is pruned before this percent of its training (warm-up makes early NE noisy).
    prune_after_pct: int = 30
    """no trial is pruned before this percent of its training"""
    # 0: no count, the study runs until `timeout_s` (which must then be set)
    n_trials: int = 12
    """finished trials in a study, across all workers; `0`: no count (needs `timeout_s`)"""
    # The port workflow's batch sweep stops at this global batch; 0: `dlrm characterize`'s
    # default (4,096 a process on CPUs, 65,536 on GPUs).
    characterize_max_batch: int = 0
    """the port workflow's batch sweep goes no further than this global batch; `0`: `dlrm characterize`'s default (4,096 a
    process on CPUs, 65,536 on GPUs)"""
    # Each trial trains this many times, with training seeds seed, seed + 1, …, and scores
    # their mean NE: a single seed's NE varies by more than the gaps a retune is after, so
    # a best-of-n study over single runs partly selects luck. The pruner watches the first.
    seeds_per_trial: int = 1
    """each trial trains with seeds `training.seed` … `training.seed + k − 1` and scores their mean NE"""
    timeout_s: float = 0.0  # wall-clock budget per worker; 0: none
    """wall-clock budget per worker; `0`: none. Both set: the study ends at whichever comes first. `dlrm retune --timeout S`
    alone (or the retune deployment's timeout alone) bounds the study by time only: what the command gives wins over the
    config"""
    seed: int = 0
    """the sampler's seed"""
    warm_start: bool = True
    """the first trials are the nearest tuned key's best, scaled by the √ rule, the linear rule, and linear for the embeddings
    with √ for the dense layers"""
    scaling_rule: Literal["sqrt", "linear"] = "sqrt"
    """how learning rates scale with the batch size: `sqrt` or `linear`"""
    # Search ranges, [low, high]; learning rates and the others marked so on a log scale.
    embedding_lr: tuple[float, ...] = (0.005, 1.0)
    """the embeddings' learning rate"""
    dense_lr: tuple[float, ...] = (1e-4, 0.3)
    """the MLPs' learning rate"""
    # warm-up as a fraction of each trial's steps (`training.warmup_fraction`): never longer
    # than the run, whatever its batch size and length
    warmup_fraction: tuple[float, ...] = (0.0, 0.1)
    """warm-up as a fraction of each trial's steps (`training.warmup_fraction`)"""
    lr_decay: tuple[str, ...] = LR_DECAYS
    """the decay shapes to choose among"""
    embedding_eps: tuple[float, ...] = (1e-10, 1e-4)  # log
    """row-wise Adagrad's epsilon"""
    dense_weight_decay: tuple[float, ...] = (1e-9, 1e-3)  # log
    """the MLP optimizer's weight decay"""
    # L2 on the embedding rows a step touches (`training.embedding_weight_decay`): small,
    # sparse data, where most ids are seen a few times, needs it; the low end is "none".
    embedding_weight_decay: tuple[float, ...] = (1e-8, 1e-1)  # log
    """L2 on the embedding rows a step touches (log scale; the low end is "none")"""
    # Up to this many epochs per trial, with early stopping: validation NE at every epoch
    # end, the trial stops when it rises, and its best epoch count becomes
    # `training.epochs` (the run's learning-rate schedule then spans those epochs, where the
    # trial's spanned max_epochs). 1: every trial trains the configured epochs. Small, noisy
    # data often wants a second epoch; large data stops after the first. Only for a whole
    # `training.epochs`: with "auto" a trial chooses its length as the run does.
    max_epochs: int = 3
    """with a whole `training.epochs`, above 1: each trial trains up to this many epochs, is scored on all validation rows at
    every epoch end and stops when that NE rises (early stopping); its best epoch count becomes `training.epochs`. With
    `training.epochs = "auto"` a trial chooses its length as the run does, on its validation rows, and this key is unused"""
    # Global batch sizes to choose among (`training.batch_size`); empty keeps the run's.
    # "auto": the run's batch, its half and its quarter (see `search_batches`): the run's
    # batch is what the hardware runs well (`dlrm characterize`, the port workflow set it),
    # and small or noisy data often trains better at a smaller one.
    batch_sizes: tuple[int, ...] | Literal["auto"] = "auto"
    """global batch sizes to choose among (`training.batch_size`); `"auto"`: the run's batch (after `training.min_steps` has
    fitted it), its half and its quarter, never below 32 rows a process (the run's batch is what the hardware runs well: `dlrm
    characterize` measures it; small or noisy data often trains better below it); `[]` keeps the run's. The port workflow
    (`characterize_then_retune`) retunes at the hardware's batch only"""
    # Optional: the dense optimizer as a searched choice ("adagrad", "adam"); empty keeps
    # the configured one. Large batches often favour Adam for the MLPs.
    dense_optimizers: tuple[str, ...] = ()
    """optional: `["adagrad", "adam"]` makes the MLPs' optimizer a choice; empty keeps the configured one"""
    # Optional architecture search: empty keeps the configured shape.
    embedding_dims: tuple[int, ...] = ()
    """optional: embedding widths to choose among; empty keeps the configured shape"""
    mlp_width_factors: tuple[float, ...] = ()  # multiplies every hidden MLP width
    """optional: factors that multiply every hidden MLP width; empty keeps the configured shape"""
    # The objective is NE on validation rows, never on the evaluation days: these training
    # days when set (trials train on the others), else as `validation` says:
    # "newest_days": the newest `validation_newest_days` training days (progressive
    # validation: trials are chosen for the days after the ones they trained on, as a
    # nightly model is judged); "random": `validation_percent` % of the training rows,
    # picked by a hash of each row (trials train on the rest); "auto": newest_days on a
    # dated warehouse with more training days than that, else random.
    validation_days: tuple[int, ...] = ()  # written as data.train_days are (dates too), held as integers
    """training days (written as `data.train_days` writes them) whose NE is the objective (trials train on the other training
    days); never the evaluation days. Empty: as `validation` says"""
    validation: Literal["auto", "newest_days", "random"] = "auto"
    """with no `validation_days`: `"newest_days"` scores trials on the newest `validation_newest_days` training days (progressive
    validation: trials are chosen for the days after those they trained on, as a nightly model is judged); `"random"` on
    `validation_percent` % of the training rows; `"auto"`: newest days on a dated warehouse with more training days than that,
    else random"""
    validation_newest_days: int = 1
    """the newest training days progressive validation scores trials on"""
    validation_percent: float = 10.0
    """with random validation: the percent of training rows, picked by a hash of each row, that trials are scored on (they train
    on the rest; the final run trains on all)"""
    # With random validation, score each trial on this many disjoint slices of
    # `validation_percent` % (k-fold: each run trains on the rest); 0: 3 on small data
    # (fewer than 50,000 training rows), where one slice's NE is too noisy to rank trials,
    # else 1. Each fold costs a run.
    validation_folds: int = 0
    """with random validation: score each trial on this many disjoint slices of `validation_percent` % (k-fold: each fold's run
    trains on the rest; the trial's NE is their mean, and the verdict against the configured values is a paired bootstrap over
    every fold's rows). `0`: 3 on small data (under 50,000 training rows), else 1. Each fold costs a run"""
    # A worker that stops beating for `3 × heartbeat_s` is dead; its trial is retried.
    heartbeat_s: int = 10
    """a worker silent for 3 × this is dead; its trial is marked failed and queued again"""

    @classmethod
    def normalised(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The TOML form with `validation_days` as integers (ISO dates: days since 1970-01-01)."""
        days = raw.get("validation_days", ())
        if not isinstance(days, (list, tuple)):
            return raw  # the type check names the key
        try:
            return {**raw, "validation_days": [parse_day(day) for day in days]}
        except DayError as error:
            raise ValueError(f"validation_days: {error}") from None

    def __post_init__(self) -> None:
        for name in ("embedding_lr", "dense_lr", "warmup_fraction", "embedding_eps", "dense_weight_decay",
                     "embedding_weight_decay"):
            bounds = getattr(self, name)
            if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
                raise ValueError(f"{name}: expected [low, high] with 0 ≤ low ≤ high, got {list(bounds)}")
        for name in ("embedding_lr", "dense_lr", "embedding_eps", "dense_weight_decay", "embedding_weight_decay"):
            if getattr(self, name)[0] <= 0:
                raise ValueError(f"{name}: a log-scale range needs low > 0, got {list(getattr(self, name))}")
        if self.warmup_fraction[1] >= 1:
            raise ValueError(f"warmup_fraction: must stay below 1 (the whole run), got {list(self.warmup_fraction)}")
        unknown = sorted(set(self.lr_decay) - set(LR_DECAYS))
        if not self.lr_decay or unknown:
            raise ValueError(f"lr_decay: choose among {list(LR_DECAYS)}, got {list(self.lr_decay)}")
        if not 0 <= self.prune_after_pct < 100:
            raise ValueError(f"prune_after_pct: must be in [0, 100), got {self.prune_after_pct}")
        if self.validation_newest_days < 1:
            raise ValueError(f"validation_newest_days: must be at least 1, got {self.validation_newest_days}")
        if self.validation_folds < 0 or self.validation_folds * self.validation_percent > 100:
            raise ValueError(f"validation_folds: {self.validation_folds} slices of validation_percent = "
                             f"{self.validation_percent:g} % do not fit in the rows (0: automatic)")
        if not 0 < self.validation_percent < 100:
            raise ValueError(f"validation_percent: must be in (0, 100), got {self.validation_percent}")
        if self.n_trials < 0 or (self.n_trials == 0 and not self.timeout_s):
            raise ValueError(f"n_trials: must be at least 1, or 0 (no count) with a timeout_s, got {self.n_trials}")
        if self.seeds_per_trial < 1:
            raise ValueError(f"seeds_per_trial: must be at least 1, got {self.seeds_per_trial}")
        if self.timeout_s < 0 or self.heartbeat_s < 1:
            raise ValueError("timeout_s: must be ≥ 0, with heartbeat_s ≥ 1")
        if set(self.dense_optimizers) - {"adagrad", "adam"}:
            raise ValueError(f"dense_optimizers: choose among ['adagrad', 'adam'], got {list(self.dense_optimizers)}")
        if self.characterize_max_batch < 0:
            raise ValueError(f"characterize_max_batch: must be ≥ 0 (0: the default), got {self.characterize_max_batch}")
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs: must be at least 1, got {self.max_epochs}")
        if self.batch_sizes != "auto" and any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes: must be positive, got {list(self.batch_sizes)}")
        if any(d <= 0 or d % 4 for d in self.embedding_dims) or any(f <= 0 for f in self.mlp_width_factors):
            raise ValueError("embedding_dims: dimensions must be positive multiples of 4 and width factors positive, "
                             f"got {list(self.embedding_dims)} and {list(self.mlp_width_factors)}")


def budget_overrides(n_trials: int | None, timeout_s: float | None) -> list[str]:
    """A study's budget given per call (`dlrm retune --trials/--timeout`, the retune
    deployment's fields), as config overrides. What the call gives wins over the config: a
    timeout alone bounds the study by time only (the config's trial count is dropped); a
    count alone keeps the config's timeout; both: whichever ends it first."""
    if timeout_s and not n_trials:
        return [f"tuning.timeout_s={timeout_s}", "tuning.n_trials=0"]
    return [*([f"tuning.n_trials={n_trials}"] if n_trials else []), *([f"tuning.timeout_s={timeout_s}"] if timeout_s else [])]
