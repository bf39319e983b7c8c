"""The whole run's configuration: one frozen dataclass tree loaded from TOML and validated.

An unknown key, a wrong type or an impossible value raises `ConfigError` with one line that
names the key, e.g. `configs/demo.toml: training.batch_size: expected int, got str 'big'`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from evaluation.config import CRITEO_SLICE_FEATURE, EvaluationConfig
from ingestion.config import DataConfig, PreprocessConfig
from ingestion.schema import SPARSE_COLUMNS
from training.config import ClusterConfig, ModelConfig, ShardingConfig, TrainingConfig
from training.tuning.config import TuningConfig


class ConfigError(ValueError):
    """A configuration problem, phrased as one line for the user."""


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow. An empty `tracking_uri` means SQLite in the run directory, and then a new
    experiment's artifacts go to `<run_dir>/mlartifacts` unless `artifact_location` says."""

    tracking_uri: str = ""
    artifact_location: str = ""
    # Serialises promotions: empty means a file lock beside a SQLite store; set a
    # postgresql:// URL when runs on several hosts share one registry.
    promotion_lock: str = ""
    experiment: str = "dlrm"
    registered_model: str = "dlrm-ctr"
    # A finished run waits this long for an unreachable tracking server, then is saved
    # locally for the next run to upload.
    outage_wait_s: float = 300.0
    # The device the registered model is served on: its fbgemm requirement is the CPU
    # build (cpu) or the CUDA build (cuda), and it scores there by default.
    serving_device: Literal["cpu", "cuda"] = "cpu"


@dataclass(frozen=True)
class OrchestrationConfig:
    """Prefect: how many stage tasks (days) run at once, and when `dlrm serve` runs the
    nightly pipeline (cron, in `timezone`)."""

    max_workers: int = 2
    # "threads" locally; "dask" sends the per-day tasks to the Dask cluster at
    # `dask_address` (docs/cluster.md).
    task_runner: Literal["threads", "dask"] = "threads"
    dask_address: str = ""
    nightly_cron: str = "0 2 * * *"
    timezone: str = "UTC"
    # Training jobs (the pipeline's training stage, each retune trial) at once on the
    # trainers, through a Prefect concurrency limit: a scheduled retune waits for a
    # retrain's training instead of sharing its cores. 0: no limit.
    trainer_slots: int = 1
    # The hosts the pipeline's training stage spans: each serves its part with
    # `dlrm serve --trainer-node R` (docs/cluster.md); node 0 hosts the rendezvous at
    # `rdzv_endpoint` (HOST:PORT). 1: training runs on the flow's host.
    trainer_hosts: int = 1
    rdzv_endpoint: str = ""
    # The trainer hosts' hardware as a cluster file (configs/clusters/), for the tuning key
    # when the flow runs on a host unlike them; "": the trainers are like the flow's host.
    trainer_cluster: str = ""

    def __post_init__(self) -> None:
        if self.trainer_hosts < 1:
            raise ValueError(f"trainer_hosts: must be at least 1, got {self.trainer_hosts}")
        if self.trainer_hosts > 1 and not self.rdzv_endpoint:
            raise ValueError("trainer_hosts: several hosts need rdzv_endpoint, node 0's HOST:PORT (e.g. 10.0.0.1:29400)")
        if self.trainer_slots < 0:
            raise ValueError(f"trainer_slots: must be ≥ 0 (0: no limit), got {self.trainer_slots}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers: must be at least 1, got {self.max_workers}")
        if self.task_runner == "dask" and not self.dask_address:
            raise ValueError("task_runner: 'dask' needs dask_address (e.g. tcp://scheduler:8786)")
        if len(self.nightly_cron.split()) != 5:
            raise ValueError(f"nightly_cron: expected 5 cron fields, got {self.nightly_cron!r}")


@dataclass(frozen=True)
class PipelineConfig:
    name: str = "demo"
    # Everything a run writes lives here; relative paths elsewhere are taken from it.
    run_dir: str = "runs/demo"
    data: DataConfig = field(default_factory=DataConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)

    def __post_init__(self) -> None:
        self._check_slice_feature()
        validation = set(self.tuning.validation_days)
        if validation - set(self.data.train_days):
            raise ValueError(
                f"tuning.validation_days: day(s) {sorted(validation - set(self.data.train_days))} are not among "
                "data.train_days; tuning validates on training days only, never on the evaluation days"
            )
        if validation and validation >= set(self.data.train_days):
            raise ValueError("tuning.validation_days: leaves no training day for the trials; leave it empty to "
                             "validate on a slice of the training rows (tuning.validation_percent)")
        written = {"run_dir": self.run_dir, "data.raw_dir": self.data.raw_dir,
                   "data.warehouse_dir": self.data.warehouse_dir, "preprocess.features_dir": self.preprocess.features_dir}
        for key, value in written.items():
            if "://" in value:
                # days and features are published by renaming a finished folder into place,
                # which object stores cannot do atomically
                raise ValueError(f"{key}: {value!r} is a URL, but the pipeline writes there with atomic renames "
                                 "that object stores lack; mount a shared file system on every host and give its "
                                 "path (raw files may be URLs: data.files)")  # fmt: skip

    def _check_slice_feature(self) -> None:
        categorical = self.data.sparse if self.data.source == "parquet" else SPARSE_COLUMNS
        feature = self.evaluation.slice_feature
        if feature in categorical:
            return
        if self.data.source == "parquet" and feature == CRITEO_SLICE_FEATURE:  # the default: the first id column
            object.__setattr__(self, "evaluation", dataclasses.replace(self.evaluation, slice_feature=categorical[0]))
            return
        raise ValueError(f"evaluation.slice_feature: {feature!r} is not a categorical feature of the data "
                         f"({', '.join(categorical[:6])}{', …' if len(categorical) > 6 else ''})")  # fmt: skip

    def path(self, relative: str) -> Path:
        """A configured path, resolved against the run directory unless absolute or a URL."""
        if "://" in relative:
            return Path(relative)
        candidate = Path(relative).expanduser()
        return candidate if candidate.is_absolute() else Path(self.run_dir).resolve() / candidate

    @property
    def artifact_location(self) -> str | None:
        """Where a new experiment keeps artifacts; None lets a tracking server decide."""
        if self.tracking.artifact_location:
            return self.tracking.artifact_location
        if self.tracking.tracking_uri:
            return None
        return str(Path(self.run_dir).resolve() / "mlartifacts")

    @property
    def optuna_storage(self) -> str:
        if self.tuning.storage:
            return self.tuning.storage
        return f"sqlite:///{Path(self.run_dir).resolve() / 'optuna.db'}"

    @property
    def tracking_uri(self) -> str:
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        return f"sqlite:///{Path(self.run_dir).resolve() / 'mlflow.db'}"


PROJECT_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# More folders whose configs flows may read (os.pathsep-separated); `dlrm` adds the folder
# of the config it was given.
CONFIG_DIRS_ENV = "DLRM_CONFIG_DIRS"


def load_flow_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> PipelineConfig:
    """`load_config` for a flow's parameter: the file must lie in the project's `configs/` or
    a folder of DLRM_CONFIG_DIRS, so a Run-button parameter cannot read any file on the host."""
    resolved = (Path(path) if Path(path).is_absolute() else Path.cwd() / path).resolve()
    roots = [PROJECT_CONFIGS, *(Path(p).resolve() for p in os.environ.get(CONFIG_DIRS_ENV, "").split(os.pathsep) if p)]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise ConfigError(
            f"{path}: configs are read only from {', '.join(map(str, roots))}; "
            f"put it there or add its folder to {CONFIG_DIRS_ENV}"
        )
    config = load_config(resolved, overrides)
    _check_override_paths(load_config(resolved), config)
    return config


# More folders that a flow parameter may point data paths at (os.pathsep-separated).
DATA_DIRS_ENV = "DLRM_DATA_DIRS"


def _data_paths(config: PipelineConfig) -> dict[str, list[str]]:
    def local(relative: str) -> str:
        return str(config.path(relative).resolve())  # resolve: "../" cannot climb out unseen

    return {
        "run_dir": [str(Path(config.run_dir).expanduser().resolve())],
        "data.raw_dir": [local(config.data.raw_dir)],
        "data.warehouse_dir": [local(config.data.warehouse_dir)],
        "preprocess.features_dir": [local(config.preprocess.features_dir)],
        "data.files": [f if "://" in f else local(f) for f in config.data.files],
        "data.path": [config.data.path if "://" in config.data.path else local(config.data.path)] if config.data.path else [],
    }


def _check_override_paths(base: PipelineConfig, config: PipelineConfig) -> None:
    """Paths that overrides moved must stay under the config's own run folder or a folder
    of DLRM_DATA_DIRS: a flow parameter cannot point the pipeline at the rest of the host."""
    roots = [_data_paths(base)["run_dir"][0], *os.environ.get(DATA_DIRS_ENV, "").split(os.pathsep)]
    roots = [r if "://" in r else str(Path(r).resolve()) for r in roots if r]
    before = _data_paths(base)
    for key, paths in _data_paths(config).items():
        for path in paths:
            if path in before[key] or any(_within(path, root) for root in roots):
                continue
            raise ConfigError(
                f"{key}: {path} is outside {', '.join(roots)}; flows keep data under the run folder "
                f"(add a folder to {DATA_DIRS_ENV} to allow it)"
            )


def _within(path: str, root: str) -> bool:
    if "://" in path or "://" in root:
        return path.startswith(root.rstrip("/") + "/")
    return Path(path).is_relative_to(root)


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> PipelineConfig:
    """Read a TOML file, apply `section.key=value` overrides (TOML values), validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass --config with a TOML file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # editors on Windows start files with a BOM
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8") from None
    for override in overrides:
        _apply_override(raw, override, path)
    try:
        raw = expand_environment(raw, prefix="")
        return build_dataclass(PipelineConfig, raw, prefix="")
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_environment(value: Any, prefix: str) -> Any:
    """`${NAME}` in string values, from the environment: credentials and service URLs stay
    out of config files (docker-compose passes them from `.env`)."""
    if isinstance(value, dict):
        return {k: expand_environment(v, f"{prefix}{k}.") for k, v in value.items()}
    if isinstance(value, list):
        return [expand_environment(v, prefix) for v in value]
    if not isinstance(value, str):
        return value

    def lookup(match: re.Match[str]) -> str:
        name = match[1]
        if name not in os.environ:
            raise ConfigError(f"{prefix.rstrip('.')}: refers to ${{{name}}}, which is not set; export {name}")
        return os.environ[name]

    return ENV_REFERENCE.sub(lookup, value)


def _apply_override(raw: dict[str, Any], override: str, path: Path) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{path}: override '{override}' is not of the form section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is taken as a string, as a shell user would expect
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: override '{key}': '{part}' is not a section")
    node[leaf] = value


# Keys that moved, so an older config gets told where to (old key → new key).
MOVED_KEYS = {
    **{f"training.cpu_{name}": f"[training.cpu] {name}" for name in ("embedding_update", "interaction", "matmul", "malloc")},
    "tuning.warmup_steps": "tuning.warmup_fraction (a fraction of each trial's steps, e.g. [0.0, 0.1])",
}


def build_dataclass(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a TOML table, checking keys and types on the way down."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    moved = MOVED_KEYS.get(f"{prefix}{unknown[0]}") if unknown else None
    if moved:
        raise ConfigError(f"{prefix}{unknown[0]}: this key is now {moved}; rename it in the config")
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key (known keys here: {', '.join(sorted(fields))})"
        )
    values = {name: _convert(hints[name], data[name], f"{prefix}{name}") for name in data}
    try:
        return cls(**values)
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{prefix}{error}") from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, prefix=f"{key}.")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return {name: _convert(value_hint, item, f"{key}.{name}") for name, item in value.items()}
    if origin is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_convert(item_hint, item, f"{key}[{i}]") for i, item in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        return value
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: type, value: Any, key: str) -> Any:
    # bool is a subclass of int in Python: `batch_size = true` must not pass as 1.
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}"
    )


def trainer_cluster(config: PipelineConfig) -> ClusterConfig | None:
    """The declared hardware of the trainer hosts (`orchestration.trainer_cluster`), if any.
    A relative path is taken from the project's folder."""
    declared = config.orchestration.trainer_cluster
    if not declared:
        return None
    path = Path(declared).expanduser()
    cluster = load_cluster(path if path.is_absolute() else PROJECT_CONFIGS.parent / path)
    if cluster.hosts != config.orchestration.trainer_hosts:
        raise ConfigError(f"orchestration.trainer_cluster: {declared} declares {cluster.hosts} host(s), but "
                          f"orchestration.trainer_hosts is {config.orchestration.trainer_hosts}; make them agree")  # fmt: skip
    return cluster


def load_cluster(path: str | Path) -> ClusterConfig:
    """A declared cluster from TOML, validated like a run config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: cluster file not found; pass --cluster with a TOML file")
    try:
        return build_dataclass(ClusterConfig, tomllib.loads(path.read_text()), prefix="")
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def config_as_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain data (tuples become lists), for logging and JSON."""
    return json_ready(dataclasses.asdict(config))


def json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}`: MLflow params are flat."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
