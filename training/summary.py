"""What a finished training job reports: `summary.json`, written by rank 0, read by the flows.

The worker and the flows share one typed record, `TrainSummary`; `load` checks the file
against it, so a missing or mistyped field is one clear error instead of a `KeyError` (or
a wrong default) somewhere downstream.
"""

from __future__ import annotations

import json
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class SchemaError(ValueError):
    """A JSON record that does not match its dataclass."""


@dataclass(frozen=True)
class TrainSummary:
    steps: int  # the step training ended at (counting steps before a resume)
    samples: int  # samples trained by this launch after its first step (the timed ones)
    seconds: float  # their training time (first step, evaluations and checkpoints excluded)
    samples_per_s: float  # samples / seconds: this launch's training throughput
    first_step_seconds: float  # compilation, allocation and cache warm-up happen here
    compiled: bool  # training.compile: the dense parts ran as compiled graphs
    precision: str  # "fp32" or "bf16": what `training.precision` (e.g. "auto") resolved to here
    cpu: dict[str, str]  # which CPU kernel computed what (e.g. "interaction": "native"); empty on GPUs
    rows_trained: int  # by all ranks over the whole run, resumes included
    rows_fingerprint: int  # Σ of the trained rows' hashes mod 2**64: which rows, in any order
    resumed_from_step: int  # the checkpoint step this launch started from (0: a fresh start)
    world_size: int  # training processes
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    pipeline: str  # how steps ran: "plain" or "sparse_dist" (TorchRec's TrainPipelineSparseDist)
    checkpoint: str  # the final checkpoint's folder
    eval_rows_rank0: int  # evaluation rows rank 0 scored into predictions/

    def save(self, path: Path) -> None:
        """Write the summary whole: a reader never sees half of it."""
        staged = path.with_name(path.name + ".staged")
        staged.write_text(json.dumps(asdict(self), indent=2) + "\n")
        staged.replace(path)

    @classmethod
    def load(cls, path: Path) -> TrainSummary:
        """The summary in `path`; `SchemaError` names any field missing or of the wrong type."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise SchemaError(f"{path}: not JSON ({error})") from None
        return from_json(cls, data, str(path))


def from_json(cls: type[T], data: Any, where: str) -> T:
    """An instance of the dataclass `cls` from its JSON form, every field checked.

    Fields with a default may be left out; keys that are not fields are ignored (a newer
    writer may add some). An int is accepted for a float field; a bool never for a number.
    """
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise SchemaError(f"{where}: {cls.__name__} is missing field(s) {', '.join(missing)}")
    values = {}
    for field in fields(cls):
        if field.name in data:
            values[field.name] = _checked(hints[field.name], data[field.name], f"{where}: {cls.__name__}.{field.name}")
    return cls(**values)


def _checked(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise SchemaError(f"{where}: expected one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected an object, got {type(value).__name__} {value!r}")
        return {_checked(key_hint, k, f"{where}[{k!r}]"): _checked(value_hint, v, f"{where}[{k!r}]")
                for k, v in value.items()}  # fmt: skip
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint):
        raise SchemaError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value
