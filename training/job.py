"""A training job: what the launcher hands to every torchrun worker, as one JSON file."""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from evaluation.config import EvaluationConfig
from training.config import ModelConfig, ShardingConfig, TrainingConfig


@dataclass(frozen=True)
class TrainJob:
    model: ModelConfig
    sharding: ShardingConfig
    training: TrainingConfig
    evaluation: EvaluationConfig
    table_sizes: dict[str, int]
    train_files: tuple[str, ...]
    eval_files: dict[str, tuple[str, ...]]  # day (as text, for JSON) → that day's feature files
    out_dir: str
    # Checkpoints of one run live under out_dir/checkpoints/<run_id>: a relaunch of the same
    # run (torchrun restart, task retry) resumes from them; a new run starts fresh.
    run_id: str = "default"
    # Start from this checkpoint's weights (any world size), e.g. to warm-start a new run.
    init_checkpoint: str = ""
    # ... and its optimizer state (a recurring run continuing the champion): no fresh
    # Adagrad accumulators, no second warm-up from zero.
    init_optimizer: bool = False
    # Mean ids per example of the multi-hot features (the planner's pooling factors).
    pooling_factors: dict[str, float] = field(default_factory=dict)
    # The dense features the bottom MLP takes (the preprocessing state's; Criteo: 13).
    dense_features: int = 13
    # A fresh model's logit starts at this click rate (the training days'); 0: PyTorch's init.
    initial_click_rate: float = 0.0

    @property
    def out(self) -> Path:
        return Path(self.out_dir)

    @property
    def checkpoint_root(self) -> Path:
        return self.out / "checkpoints" / self.run_id

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> TrainJob:
        return _from_plain(cls, json.loads(Path(path).read_text()))


def _from_plain(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a (validated) dataclass from its JSON form: lists back to tuples."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _rebuild(hints[f.name], data[f.name]) for f in fields(cls) if f.name in data})


def _rebuild(hint: Any, value: Any) -> Any:
    if is_dataclass(hint):
        return _from_plain(hint, value)
    if typing.get_origin(hint) is dict:
        _, value_hint = typing.get_args(hint)
        return {key: _rebuild(value_hint, item) for key, item in value.items()}
    return tuple(value) if isinstance(value, list) else value
