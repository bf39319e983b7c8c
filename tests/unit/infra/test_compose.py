"""docker-compose.yml, checked by parsing (no Docker engine here); the commands its services
run are exercised natively in tests/integration/test_production_stack.py."""

import os
import re
import subprocess
from pathlib import Path

import prefect
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_the_stack_has_its_services() -> None:
    assert {"postgres", "prefect-server", "mlflow", "trainer", "trainer-gpu"} <= set(SERVICES)


def test_every_service_waits_for_healthy_dependencies() -> None:
    for name in ("postgres", "prefect-server", "mlflow"):
        assert SERVICES[name]["healthcheck"]["test"], name
    assert SERVICES["prefect-server"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert SERVICES["mlflow"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for trainer in ("trainer", "trainer-gpu"):
        conditions = {d: c["condition"] for d, c in SERVICES[trainer]["depends_on"].items()}
        assert conditions == {"prefect-server": "service_healthy", "mlflow": "service_healthy"}


def test_postgres_init_creates_one_database_per_service() -> None:
    mounts = SERVICES["postgres"]["volumes"]
    assert "./infra/postgres/init.sql:/docker-entrypoint-initdb.d/init.sql:ro" in mounts
    sql = (ROOT / "infra" / "postgres" / "init.sql").read_text()
    assert set(re.findall(r"CREATE DATABASE (\w+);", sql)) == {"prefect", "mlflow", "optuna"}


def test_prefect_server_is_the_client_version_on_postgres() -> None:
    server = SERVICES["prefect-server"]
    assert server["image"].split(":")[1].startswith(f"{prefect.__version__}-")
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_HOST"} <= set(server["environment"])
    assert "database_url postgresql+asyncpg prefect" in (ROOT / "infra" / "prefect-server.sh").read_text()
    assert server["command"] == ["/infra/prefect-server.sh"]


def test_prefect_server_keeps_its_concurrency_leases_on_a_volume() -> None:
    """The trainer slots' leases outlive a restart of the server (flows/stages/trainer_slots.py)."""
    server = SERVICES["prefect-server"]
    home = server["environment"]["PREFECT_HOME"]
    assert f"prefect-home:{home}" in server["volumes"] and "prefect-home" in COMPOSE["volumes"]
    script = (ROOT / "infra" / "prefect-server.sh").read_text()
    assert "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE:-prefect.server.concurrency.lease_storage.filesystem}" in script


def test_mlflow_uses_postgres_served_artifacts_and_allowed_hosts() -> None:
    mlflow = SERVICES["mlflow"]
    env = mlflow["environment"]
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_HOST"} <= set(env)
    assert "database_url postgresql mlflow" in (ROOT / "infra" / "mlflow-server.sh").read_text()
    assert env["MLFLOW_ARTIFACTS_DESTINATION"] == "/mlartifacts"
    assert "mlflow-artifacts:/mlartifacts" in mlflow["volumes"]
    assert "mlflow" in env["MLFLOW_ALLOWED_HOSTS"].split(",")
    script = (ROOT / "infra" / "mlflow-server.sh").read_text()
    assert "--serve-artifacts" in script and "--allowed-hosts" in script


def test_the_gpu_profile_reserves_nvidia_devices_for_the_trainer() -> None:
    gpu = SERVICES["trainer-gpu"]
    assert gpu["profiles"] == ["gpu"] and "profiles" not in SERVICES["trainer"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["build"]["args"]["FBGEMM"] == "fbgemm-gpu"


def test_trainer_serves_the_deployments_with_an_existing_config() -> None:
    command = SERVICES["trainer"]["command"]
    assert command[:2] == ["dlrm", "serve"]
    assert (ROOT / command[command.index("--config") + 1]).is_file()
    assert SERVICES["trainer"]["build"]["dockerfile"] == "infra/Dockerfile"
    assert (ROOT / "infra" / "Dockerfile").is_file()


def test_no_credentials_are_committed_and_ports_stay_on_loopback() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", text):
        assert password.startswith("${"), f"a literal password in docker-compose.yml: {password}"
    assert SERVICES["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD")
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout.strip() == "" and (ROOT / ".env.example").is_file()
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_service_scripts_are_executable_and_refuse_to_start_unconfigured() -> None:
    for script in ("prefect-server.sh", "mlflow-server.sh"):
        path = ROOT / "infra" / script
        assert os.access(path, os.X_OK), script
        env = {"PATH": os.environ["PATH"]}
        result = subprocess.run([str(path)], env=env, capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode != 0 and "set it to" in result.stderr, script


@pytest.mark.parametrize("name", ["production.toml"])
def test_the_production_config_takes_its_urls_from_the_environment(name: str, monkeypatch) -> None:
    from flows.run.config import ConfigError, load_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"tracking.tracking_uri: refers to \$\{MLFLOW_TRACKING_URI\}"):
        load_config(ROOT / "configs" / name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    monkeypatch.setenv("DLRM_LOCK_URL", "postgresql://u:p@postgres:5432/optuna")
    monkeypatch.setenv("OPTUNA_STORAGE", "postgresql://u:p@postgres:5432/optuna")
    config = load_config(ROOT / "configs" / name)
    assert config.tracking_uri == "http://mlflow:5000" and config.optuna_storage.endswith("/optuna")


def _trainer_env(password: str) -> subprocess.CompletedProcess:
    """infra/trainer-env.sh, the trainers' entrypoint, run natively with `env` as its command."""
    env = {"PATH": os.environ["PATH"], "POSTGRES_USER": "dlrm user", "POSTGRES_PASSWORD": password,
           "POSTGRES_HOST": "postgres:5432"}  # fmt: skip
    return subprocess.run([str(ROOT / "infra" / "trainer-env.sh"), "env"], env=env, capture_output=True,
                          text=True, timeout=30, check=False)  # fmt: skip


def test_credentials_are_url_encoded_into_every_database_url() -> None:
    from sqlalchemy.engine import make_url

    password = "p@ss/w:rd%"
    done = _trainer_env(password)
    assert done.returncode == 0, done.stderr
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    url = make_url(exported["OPTUNA_STORAGE"])
    assert (url.username, url.password, url.host, url.port, url.database) == ("dlrm user", password, "postgres",
                                                                               5432, "optuna")  # fmt: skip
    assert exported["DLRM_LOCK_URL"] == exported["OPTUNA_STORAGE"]
    trainer = SERVICES["trainer"]
    assert trainer["entrypoint"] == ["/opt/dlrm/infra/trainer-env.sh"]
    assert not {"OPTUNA_STORAGE", "DLRM_LOCK_URL"} & set(trainer["environment"]), "built, encoded, in the container"


@pytest.mark.parametrize("password", ["change-me", ""])
def test_the_example_password_and_no_password_are_refused_in_one_line(password: str) -> None:
    done = _trainer_env(password)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "POSTGRES_PASSWORD" in done.stderr


def test_the_image_runs_as_a_user_and_carries_no_local_state() -> None:
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), "the last USER is not root"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "runs", ".env", ".git", ".prefect"} <= set(ignored)


def test_each_trainer_has_its_own_data_and_a_health_check() -> None:
    volumes = {name: SERVICES[name]["volumes"] for name in ("trainer", "trainer-gpu")}
    assert volumes["trainer"] != volumes["trainer-gpu"]
    assert {v.split(":")[0] for v in volumes["trainer-gpu"]} <= set(COMPOSE["volumes"])
    for name in ("trainer", "trainer-gpu"):
        assert "8080/health" in " ".join(SERVICES[name]["healthcheck"]["test"])
        assert SERVICES[name]["environment"]["PREFECT_RUNNER_SERVER_ENABLE"] == "true"
