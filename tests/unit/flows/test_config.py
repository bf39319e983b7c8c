import re
from pathlib import Path

import pytest

from flows.run.config import ConfigError, PipelineConfig, config_as_dict, flatten, load_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["demo.toml", "tiny.toml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_config(ROOT / "configs" / name)
    assert isinstance(config, PipelineConfig)
    assert config.model.bottom_mlp[-1] == config.model.embedding_dim
    assert config.training.batch_size % config.training.nproc == 0


def _error(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    message = str(caught.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_unknown_key_names_the_key_and_the_known_ones(tmp_path: Path) -> None:
    message = _error(tmp_path, "[training]\nbatch_sise = 10\n")
    assert "training.batch_sise: unknown key" in message
    assert "batch_size" in message


def test_unknown_section_is_named(tmp_path: Path) -> None:
    assert "trainer: unknown key" in _error(tmp_path, "[trainer]\nnproc = 2\n")


def test_wrong_type_names_key_expected_and_got(tmp_path: Path) -> None:
    message = _error(tmp_path, '[training]\nbatch_size = "big"\n')
    assert "training.batch_size: expected int, got str 'big'" in message


def test_bool_is_not_an_int(tmp_path: Path) -> None:
    assert "training.nproc: expected int, got bool" in _error(tmp_path, "[training]\nnproc = true\n")


def test_int_is_accepted_for_float(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[training]\nembedding_lr = 1\n")
    assert load_config(path).training.embedding_lr == 1.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[training]\nbatch_size = 0\n", "training.batch_size: must be positive, got 0"),
        ("[training]\nnproc = 3\nbatch_size = 1024\n",
         "training.batch_size: 1024 is not a multiple of the world size 3 (3 processes); set a multiple of 3"),
        ("[training]\nnproc = 2\nbatch_size = 1024\n[orchestration]\ntrainer_hosts = 3\nrdzv_endpoint = 'h:1'\n",
         "training.batch_size: 1024 is not a multiple of the world size 6 (3 hosts × 2 processes)"),
        ('[training]\ntorchrun_args = ["--nnodes=2"]\n', "training.torchrun_args: ['--nnodes=2'] set the job's hosts"),
        ("[model]\nembedding_dim = 8\n", "model.bottom_mlp: must end with embedding_dim (8)"),
        ("[model]\ntop_mlp = [64, 2]\n", "model.top_mlp: must end with 1"),
        ('[sharding]\nsharding_type = "diagonal"\n', "sharding.sharding_type: must be one of"),
        ('[sharding]\nsharding_type = "data_parallel"\n', "sharding.compute_kernel: data_parallel tables use"),
        ("[data]\ntrain_days = [0, 1]\neval_days = [1]\n", "data.eval_days: [1] also in train_days"),
        ('[data]\nsource = "files"\n', "data.files: source = 'files' needs a list"),
        ("[data.synthetic]\nrows_per_day = -5\n", "data.synthetic.rows_per_day: must be positive"),
        ("[orchestration]\ntrainer_slot_lease_s = 5\n",
         "orchestration.trainer_slot_lease_s: the Prefect server takes leases of 60 s to a day (86400), got 5"),
    ],
)
def test_impossible_values_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(tmp_path, text)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    assert "not valid TOML" in _error(tmp_path, "[training\n")


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    overrides = ["training.batch_size=4096", "run_dir=/tmp/x", "model.bottom_mlp=[64, 16]"]
    config = load_config(ROOT / "configs" / "demo.toml", overrides)
    assert config.training.batch_size == 4096
    assert config.run_dir == "/tmp/x"
    assert config.model.bottom_mlp == (64, 16)
    with pytest.raises(ConfigError, match="training.batch_size: expected int"):
        load_config(ROOT / "configs" / "demo.toml", ["training.batch_size=lots"])
    with pytest.raises(ConfigError, match="is not of the form"):
        load_config(ROOT / "configs" / "demo.toml", ["training.batch_size"])


def test_paths_resolve_against_run_dir(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs" / "tiny.toml", [f'run_dir="{tmp_path}"'])
    assert config.path("warehouse") == tmp_path / "warehouse"
    assert config.path("/abs/elsewhere") == Path("/abs/elsewhere")
    assert config.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_resolved_config_flattens_for_mlflow_params() -> None:
    flat = flatten(config_as_dict(load_config(ROOT / "configs" / "demo.toml")))
    assert flat["training.batch_size"] == 2048
    assert flat["model.bottom_mlp"] == [512, 256, 16]
    assert flat["data.synthetic.seed"] == 7


def test_flow_parameters_cannot_name_configs_outside_the_allowed_folders(tmp_path, monkeypatch) -> None:
    from flows.run.config import load_flow_config

    outside = tmp_path / "elsewhere.toml"
    outside.write_text((ROOT / "configs" / "tiny.toml").read_text())
    monkeypatch.delenv("DLRM_CONFIG_DIRS", raising=False)
    assert load_flow_config(ROOT / "configs" / "tiny.toml").name == "tiny"
    for sneaky in (outside, ROOT / "configs" / ".." / "pyproject.toml", "configs/../../etc/passwd"):
        with pytest.raises(ConfigError, match="configs are read only from"):
            load_flow_config(sneaky)
    monkeypatch.setenv("DLRM_CONFIG_DIRS", str(tmp_path))
    assert load_flow_config(outside).name == "tiny"


def test_the_day_flows_run_on_threads_or_a_named_dask_cluster() -> None:
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.stages.features import day_flow

    config = load_config(ROOT / "configs" / "tiny.toml", ["orchestration.max_workers=3"])
    runner = day_flow("ingest", config).task_runner
    assert isinstance(runner, ThreadPoolTaskRunner) and runner._max_workers == 3
    assert day_flow("preprocess", config).task_runner._max_workers == 3
    assert day_flow("ingest", config) is day_flow("ingest", config), "made once per runner, not per run"
    assert day_flow("ingest", config) is not day_flow("ingest", load_config(ROOT / "configs" / "tiny.toml"))
    with pytest.raises(ConfigError, match="dask_address"):
        load_config(ROOT / "configs" / "tiny.toml", ['orchestration.task_runner="dask"'])
    dask = load_config(ROOT / "configs" / "tiny.toml", ['orchestration.task_runner="dask"',
                                                        'orchestration.dask_address="tcp://127.0.0.1:8786"'])  # fmt: skip
    from prefect_dask import DaskTaskRunner

    runner = day_flow("preprocess", dask).task_runner  # prefect-dask is installed with the project
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://127.0.0.1:8786"


def test_flow_overrides_cannot_move_data_paths_out_of_the_run_folder(tmp_path, monkeypatch) -> None:
    from flows.run.config import load_flow_config

    tiny = ROOT / "configs" / "tiny.toml"
    monkeypatch.delenv("DLRM_DATA_DIRS", raising=False)
    inside = load_flow_config(tiny, ['data.warehouse_dir="warehouse-2"', "training.batch_size=512"])
    assert inside.path(inside.data.warehouse_dir).name == "warehouse-2"
    for override in ['run_dir="/etc"', 'data.warehouse_dir="../../../../etc"', 'data.raw_dir="/root"',
                     'data.source="files"', 'preprocess.features_dir="/var/lib"']:  # fmt: skip
        extra = ['data.files=["/etc/shadow"]'] if "source" in override else []
        with pytest.raises(ConfigError, match="outside"):
            load_flow_config(tiny, [override, *extra])
    monkeypatch.setenv("DLRM_DATA_DIRS", str(tmp_path))
    assert load_flow_config(tiny, [f'run_dir="{tmp_path / "run"}"']).run_dir == str(tmp_path / "run")


def test_the_cli_trusts_the_paths_its_user_names(monkeypatch) -> None:
    import os

    from flows.cli import _trust_override_paths

    monkeypatch.setenv("DLRM_DATA_DIRS", "")
    _trust_override_paths(['run_dir="/srv/runs/a"', "training.batch_size=4"])
    assert os.environ["DLRM_DATA_DIRS"].split(os.pathsep) == ["/srv/runs/a"]


@pytest.mark.parametrize(("override", "named"), [
    ('preprocess.managed.policy="mru"', "preprocess.managed.policy: must be one of"),
    ("preprocess.managed.eviction_interval=0", "preprocess.managed.eviction_interval: training steps"),
    ("preprocess.managed.admit_min_count=0", "preprocess.managed.admit_min_count: at least 1"),
    ('training.pipeline="sparse_dist"', "training.pipeline: \"sparse_dist\" starts the ids' all-to-all"),
])  # fmt: skip
def test_bad_managed_id_settings_are_one_line_naming_the_key(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("configs/drifting-ids.toml", [override])


@pytest.mark.parametrize(("override", "named"), [
    ('training.epochs="sometimes"', "training.epochs: 'sometimes' is none of int | 'auto'"),
    ("training.epochs=0", 'training.epochs: must be "auto" or a whole number of at least 1, got 0'),
    ("training.patience=0", "max_epochs and patience: must be at least 1"),
    ('training.validation_rows="newest"', "training.validation_rows: must be one of ['held_out', 'newest_day']"),
])  # fmt: skip
def test_a_bad_run_length_setting_is_one_line_naming_the_key(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("configs/demo.toml", [override])
