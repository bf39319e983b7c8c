"""The whole run's configuration: one frozen dataclass tree loaded from TOML and validated.

An unknown key, a wrong type or an impossible value raises `ConfigError` with one line that
names the key, e.g. `configs/demo.toml: training.batch_size: expected int, got str 'big'`.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from evaluation.config import EvaluationConfig
from ingestion.config import DataConfig, PreprocessConfig
from ingestion.schema import SPARSE_COLUMNS
from training.codec import SchemaError, decode, encode
from training.config import ClusterConfig, ModelConfig, ShardingConfig, TrainingConfig, Workers
from training.tuning.config import TuningConfig


class ConfigError(ValueError):
    """A configuration problem, phrased as one line for the user."""


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow. An empty `tracking_uri` means SQLite in the run directory, and then a new
    experiment's artifacts go to `<run_dir>/mlartifacts` unless `artifact_location` says."""

    tracking_uri: str = ""
    """the MLflow server; empty: SQLite at `<run_dir>/mlflow.db` (a new one is a copy of an empty store that this MLflow version
    migrated once, kept in `~/.cache/dlrm-pipeline/mlflow/`: 0.05 s, not MLflow's 1–2 s of migrations)"""
    artifact_location: str = ""
    """where a new experiment keeps artifacts; empty: `<run_dir>/mlartifacts` with the SQLite default, the server's choice with a
    server"""
    # Serialises promotions: empty means a file lock beside a SQLite store; set a
    # postgresql:// URL when runs on several hosts share one registry.
    promotion_lock: str = ""
    """what serialises promotions: empty is a file lock beside a SQLite store; a `postgresql://` URL takes an advisory lock in
    that database, for runs on several hosts sharing one registry"""
    experiment: str = "dlrm"
    """the MLflow experiment"""
    registered_model: str = "dlrm-ctr"
    """the registered model whose `champion` alias promotion moves"""
    # A finished run waits this long for an unreachable tracking server, then is saved
    # locally for the next run to upload.
    outage_wait_s: float = 300.0
    """how long a finished run waits for an unreachable tracking server before saving itself under `<run_dir>/mlflow-pending/`
    for the next run to upload"""
    # The device the registered model is served on: its fbgemm requirement is the CPU
    # build (cpu) or the CUDA build (cuda), and it scores there by default.
    serving_device: Literal["cpu", "cuda"] = "cpu"
    """the device the registered model serves on: `cpu` pins fbgemm's CPU build in its requirements, `cuda` its CUDA build (and
    it scores on the GPU; `DLRM_SERVING_DEVICE` overrides that where it loads). See [serving.md](serving.md)"""


@dataclass(frozen=True)
class SlurmJobConfig:
    """`orchestration.launcher = "slurm"`: the batch job the pipeline's training stage submits
    (one `#SBATCH` line each; the node count is `orchestration.trainer_hosts`)."""

    partition: str = ""
    """the partition (`--partition`); empty: the cluster's default"""
    time_limit: str = ""
    """the job's time limit as Slurm writes it (`--time`, e.g. `02:00:00`); empty: the partition's"""
    gpus_per_node: int = 0
    """GPUs to ask for on each node (`--gpus-per-node`); `0`: none asked for"""
    sbatch_args: list[str] = field(default_factory=list)
    """further `#SBATCH` arguments, as written (e.g. `["--account=recsys", "--qos=high"]`)"""
    poll_s: float = 5.0
    """seconds between two looks at the job's state (`scontrol show job`) while the stage waits"""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node: must be ≥ 0, got {self.gpus_per_node}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {self.poll_s}")


@dataclass(frozen=True)
class OrchestrationConfig:
    """Prefect: how many stage tasks (days) run at once, and when `dlrm serve` runs the
    nightly pipeline (cron, in `timezone`)."""

    max_workers: int = 2
    """how many days are ingested or preprocessed at once"""
    # "threads" locally; "dask" sends the per-day tasks to the Dask cluster at
    # `dask_address` (docs/cluster.md).
    task_runner: Literal["threads", "dask"] = "threads"
    """`threads`: a local thread pool; `dask`: the per-day data stages on the Dask cluster at `dask_address` (workers on other
    hosts need a Prefect server they can reach: [cluster.md](cluster.md))"""
    dask_address: str = ""
    """the Dask scheduler, e.g. `tcp://scheduler:8786`; needed with `dask`"""
    nightly_cron: str = "0 2 * * *"
    """when `dlrm serve` runs the nightly pipeline (five cron fields)"""
    timezone: str = "UTC"
    """the time zone of `nightly_cron`"""
    # Training jobs (the pipeline's training stage, each retune trial) at once on the
    # trainers, through a Prefect concurrency limit: a scheduled retune waits for a
    # retrain's training instead of sharing its cores. 0: no limit.
    trainer_slots: int = 1
    """training jobs at once (the pipeline's training stage, each retune trial), held through the Prefect concurrency limit
    `dlrm-training`: a retune scheduled by a retrain waits for the retrain's training. `0`: no limit"""
    # A slot is a Prefect lease that its holder renews while it trains; the server revokes
    # one that nobody renews. Prefect's server takes leases of 60 s to a day.
    trainer_slot_lease_s: float = 60.0
    """how long a trainer slot stays held without its holder renewing it (60 s to a day, the Prefect server's range): a job
    that is gone without giving its slot back (SIGKILL, a lost host, a cancelled Slurm job) frees it at most this long, plus
    the server's 15 s sweep, after its last renewal, and the next training goes on"""
    # The hosts the pipeline's training stage spans: each serves its part with
    # `dlrm serve --trainer-node R` (docs/cluster.md); node 0 hosts the rendezvous at
    # `rdzv_endpoint` (HOST:PORT). 1: training runs on the flow's host.
    trainer_hosts: int = 1
    """the hosts a training job spans, `training.nproc` processes on each: the pipeline's training stage (each host serves its
    part with `dlrm serve --trainer-node R`, [cluster.md](cluster.md)), and `dlrm train` (which `--nnodes` overrides). `1`:
    training runs on the flow's host"""
    rdzv_endpoint: str = ""
    """node 0's `HOST:PORT` for the rendezvous of a multi-host training stage; needed with `trainer_hosts` > 1 (not with
    Slurm, whose allocation names node 0)"""
    # How the training stage starts its job: on the flow's host (and, with several hosts,
    # through their `train-node` deployments), or as a Slurm batch job it waits for.
    launcher: Literal["local", "slurm"] = "local"
    """how the pipeline's training stage starts its job: `"local"` on the flow's host (with `trainer_hosts` > 1, on the hosts
    serving `train-node/node-R`), or `"slurm"`: a batch job of `trainer_hosts` nodes submitted with `sbatch` from the flow's host
    and waited for (`[orchestration.slurm]`, [cluster.md](cluster.md)); stopping the flow cancels the job"""
    slurm: SlurmJobConfig = field(default_factory=SlurmJobConfig)
    # The trainer hosts' hardware as a cluster file (configs/clusters/), for the tuning key
    # when the flow runs on a host unlike them; "": the trainers are like the flow's host.
    trainer_cluster: str = ""
    """a cluster file (below; relative to the project) declaring the trainer hosts' hardware. The tuning key takes its device
    type, model and memory from it, so a CPU-only flow host driving GPU trainers looks up the GPU key; its `hosts` must equal
    `trainer_hosts`. Empty: the trainers are like the flow's host"""
    # A recurring night continues the champion on the days it has not seen: after refused
    # nights that grows. More unseen days than this stops the night with one line (0: no
    # bound), rather than retraining a longer stretch every night from a staler champion.
    max_catch_up_days: int = 0
    """a recurring night (`--as-of`) trains the days before it that the champion has not seen; after refused nights they add up.
    More than this many stops the night with one line naming the days and what to do (the flow run ends Failed). `0`: no bound"""
    # A night with too few new rows to train well waits: the champion keeps serving and the
    # next night trains these days with its own (flows/run/nights.py: waits_for_rows).
    min_night_rows: int | Literal["auto"] = "auto"
    """a recurring night whose new days hold fewer rows than this trains nothing and says so ("waiting for more rows"); the
    champion keeps serving and the next night trains these days with its own. `"auto"`: the rows that give
    `training.min_steps` optimizer steps at the smallest batch the run-length rule allows (32 rows a process), after the
    held-out rows (3,556 rows on 2 processes at the defaults); `0`: every night trains, however few its rows"""
    # What a recurring night continues: "champion" (the promoted version), or "latest" (the
    # newest version trained, promoted or not: one new day a night even after refusals,
    # while the alias stays on the best judged model).
    continue_from: Literal["champion", "latest"] = "champion"
    """what a recurring night continues: the promoted version, or `"latest"`, the newest version trained (one new day a night
    even after refusals)"""
    # After this many nights in a row without a promotion (0: never) the champion is stale:
    # the night ends Failed ("fail", the state a Prefect notification can watch) or with a
    # warning artifact and log line ("warn"). The registered model's tags say how old it is.
    stale_after_nights: int = 0
    """after this many recurring nights in a row without a promotion the champion is stale (`0`: never); the registered model's
    tags `champion.nights_without_promotion`, `champion.version`, `champion.as_of` say how old it is"""
    on_stale: Literal["fail", "warn"] = "warn"
    """a stale champion ends the night `"fail"` (flow run Failed, after the night is recorded) or `"warn"` (a `stale-champion`
    artifact and a warning)"""

    def __post_init__(self) -> None:
        if self.stale_after_nights < 0:
            raise ValueError(f"stale_after_nights: must be ≥ 0 (0: never), got {self.stale_after_nights}")
        if self.min_night_rows != "auto" and (isinstance(self.min_night_rows, bool) or self.min_night_rows < 0):
            raise ValueError(f"min_night_rows: must be \"auto\" or ≥ 0 (0: every night trains), got {self.min_night_rows!r}")
        if self.max_catch_up_days < 0:
            raise ValueError(f"max_catch_up_days: must be ≥ 0 (0: no bound), got {self.max_catch_up_days}")
        if self.trainer_hosts < 1:
            raise ValueError(f"trainer_hosts: must be at least 1, got {self.trainer_hosts}")
        if self.trainer_hosts > 1 and not self.rdzv_endpoint and self.launcher != "slurm":
            raise ValueError("trainer_hosts: several hosts need rdzv_endpoint, node 0's HOST:PORT (e.g. 10.0.0.1:29400)")
        if self.trainer_slots < 0:
            raise ValueError(f"trainer_slots: must be ≥ 0 (0: no limit), got {self.trainer_slots}")
        if not 60 <= self.trainer_slot_lease_s <= 86_400:
            raise ValueError(f"trainer_slot_lease_s: the Prefect server takes leases of 60 s to a day (86400), "
                             f"got {self.trainer_slot_lease_s}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers: must be at least 1, got {self.max_workers}")
        if self.task_runner == "dask" and not self.dask_address:
            raise ValueError("task_runner: 'dask' needs dask_address (e.g. tcp://scheduler:8786)")
        if len(self.nightly_cron.split()) != 5:
            raise ValueError(f"nightly_cron: expected 5 cron fields, got {self.nightly_cron!r}")


@dataclass(frozen=True)
class PipelineConfig:
    name: str = "demo"
    """the run's name (printed in the summary, tagged in MLflow)"""
    # Everything a run writes lives here; relative paths elsewhere are taken from it.
    run_dir: str = "runs/demo"
    """the folder everything the run writes goes into; other relative paths are taken from it"""
    data: DataConfig = field(default_factory=DataConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)

    @classmethod
    def normalised(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The TOML form with what follows from the data: a Parquet source's slice feature,
        unless named, is its first id column (Criteo's C17 is no column of it)."""
        data, evaluation = raw.get("data", {}), raw.get("evaluation", {})
        if not (isinstance(data, dict) and isinstance(evaluation, dict)):
            return raw  # the type check names the key
        sparse = data.get("sparse")
        if data.get("source") == "parquet" and "slice_feature" not in evaluation and sparse and isinstance(sparse, list):
            return {**raw, "evaluation": {**evaluation, "slice_feature": sparse[0]}}
        return raw

    @property
    def workers(self) -> Workers:
        """The training job's processes: `training.nproc` on each of `orchestration.trainer_hosts`."""
        return Workers(self.training.nproc, self.orchestration.trainer_hosts)

    def __post_init__(self) -> None:
        self._check_slice_feature()
        self.workers.per_rank_batch(self.training.batch_size)  # a batch the world size divides
        if self.preprocess.categorical_mode == "managed" and self.training.pipeline == "sparse_dist":
            raise ValueError('training.pipeline: "sparse_dist" starts the ids\' all-to-all before managed ids are '
                             'remapped; use "auto" or "plain" with preprocess.categorical_mode = "managed"')
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


@dataclass(frozen=True)
class ConfigSource:
    """Where a run's config came from: its file and the overrides (a scheduled retune is
    started with the same)."""

    path: str
    overrides: tuple[str, ...] = ()


PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# More folders whose configs flows may read (os.pathsep-separated); `dlrm` adds the folder
# of the config it was given.
CONFIG_DIRS_ENV = "DLRM_CONFIG_DIRS"


def flow_config_path(path: str | Path) -> Path:
    """A flow parameter's config file, resolved: it must lie in the project's `configs/` or a
    folder of DLRM_CONFIG_DIRS, so a Run-button parameter cannot read any file on the host."""
    resolved = (Path(path) if Path(path).is_absolute() else Path.cwd() / path).resolve()
    roots = [PROJECT_CONFIGS, *(Path(p).resolve() for p in os.environ.get(CONFIG_DIRS_ENV, "").split(os.pathsep) if p)]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise ConfigError(
            f"{path}: configs are read only from {', '.join(map(str, roots))}; "
            f"put it there or add its folder to {CONFIG_DIRS_ENV}"
        )
    return resolved


def load_flow_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> PipelineConfig:
    """`load_config` for a flow's parameter (`flow_config_path`), whose overrides keep its
    data paths where a flow may write."""
    resolved = flow_config_path(path)
    raw = read_toml(resolved)
    config = build_config(copy.deepcopy(raw), overrides, resolved)
    if overrides:
        _check_override_paths(build_config(raw, (), resolved), config)
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
    return build_config(read_toml(Path(path)), overrides, Path(path))


def read_toml(path: Path) -> dict[str, Any]:
    """The config file's TOML as a table: the one read of a command's config."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass --config with a TOML file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))  # editors on Windows start files with a BOM
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8") from None


def build_config(raw: dict[str, Any], overrides: typing.Sequence[str], path: Path) -> PipelineConfig:
    """The validated config of a TOML table with `overrides` applied (`raw` is changed)."""
    for override in overrides:
        _apply_override(raw, override, path)
    try:
        _refuse_moved_keys(raw)
        return decode(PipelineConfig, expand_environment(raw, prefix=""), strict=True)
    except (ConfigError, SchemaError) as error:
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


def _refuse_moved_keys(raw: dict[str, Any], prefix: str = "") -> None:
    for key, value in raw.items():
        if f"{prefix}{key}" in MOVED_KEYS:
            raise ConfigError(f"{prefix}{key}: this key is now {MOVED_KEYS[f'{prefix}{key}']}; rename it in the config")
        if isinstance(value, dict):
            _refuse_moved_keys(value, f"{prefix}{key}.")


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
        return decode(ClusterConfig, tomllib.loads(path.read_text()), strict=True)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except SchemaError as error:
        raise ConfigError(f"{path}: {error}") from None


def config_as_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain data (tuples become lists), for logging and JSON."""
    return encode(config)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}`: MLflow params are flat."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
