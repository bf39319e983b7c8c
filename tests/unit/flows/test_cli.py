"""The `dlrm` command as a user runs it: one-line errors, JSON outputs. (Each command is
forked from this test process's warm server, tests/warm_commands.py: its own process,
environment, output and exit code, without importing the pipeline again.)"""

import gzip
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import warm_commands
from sklearn.metrics import log_loss, roc_auc_score

ROOT = Path(__file__).resolve().parents[3]


def dlrm(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*warm_commands.dlrm(), *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dlrm: error: ")
    return lines[0]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[training]\nbatch_sise = 4\n", "training.batch_sise: unknown key"),
        ('[training]\nbatch_size = "4"\n', "training.batch_size: expected int, got str"),
        ("[model]\nembedding_dim = 0\n", "model.embedding_dim: must be a positive multiple of 4"),
        ("[model]\nembedding_dim = 6\nbottom_mlp = [32, 6]\n", "model.embedding_dim: must be a positive multiple of 4, got 6"),
    ],
)
def test_bad_config_stops_with_one_line(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    line = _one_line_error(dlrm("run", "--config", str(config)))
    assert needle in line and str(config) in line


def test_missing_config_file_and_missing_input_path(tmp_path: Path) -> None:
    assert "config file not found" in _one_line_error(dlrm("run", "--config", str(tmp_path / "none.toml")))
    config = tmp_path / "files.toml"
    config.write_text(f'run_dir = "{tmp_path}"\n[data]\nsource = "files"\nfiles = ["{tmp_path}/day_0.gz"]\n')
    line = _one_line_error(dlrm("run", "--config", str(config)))
    assert f"data.files[0]: {tmp_path}/day_0.gz does not exist" in line


def test_evaluate_json_matches_scikit_learn(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.99, 4000)
    y = (rng.random(4000) < p).astype(np.int8)
    path = tmp_path / "predictions.parquet"
    pq.write_table(pa.table({"label": y, "prediction": p}), path)
    result = dlrm("evaluate", "--predictions", str(path), "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(metrics) == {"ne", "auc", "calibration", "log_loss", "ctr", "count"}
    assert metrics["auc"] == pytest.approx(roc_auc_score(y, p), rel=1e-12)
    assert metrics["log_loss"] == pytest.approx(log_loss(y, p), rel=1e-10)
    assert metrics["count"] == 4000


def test_evaluate_rejects_bad_predictions_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"label": [0, 1, 1], "prediction": [0.2, float("nan"), 1.7]}), path)
    assert "2 of 3 predictions are NaN or outside [0, 1]" in _one_line_error(dlrm("evaluate", "--predictions", str(path)))
    pq.write_table(pa.table({"label": [0, 1]}), path)
    assert "missing column(s) ['prediction']" in _one_line_error(dlrm("evaluate", "--predictions", str(path)))


def test_bad_paths_and_files_stop_with_one_line(tmp_path: Path) -> None:
    not_parquet = tmp_path / "predictions.parquet"
    not_parquet.write_text("label,prediction\n1,0.5\n")
    line = _one_line_error(dlrm("evaluate", "--predictions", str(not_parquet)))
    assert "not a readable Parquet file" in line and str(not_parquet) in line
    day = tmp_path / "day_0"
    day.write_text("0\t1\n")
    a_file = tmp_path / "warehouse-file"
    a_file.write_text("")
    line = _one_line_error(dlrm("ingest", str(day), "--warehouse", str(a_file)))
    assert "a file, not a folder" in line and not list(tmp_path.glob("warehouse-file*/*"))
    assert "a folder; pass Criteo files" in _one_line_error(dlrm("ingest", str(tmp_path), "--warehouse", str(tmp_path / "w")))


def test_a_failed_file_is_reported_once_and_no_staging_is_left(tmp_path: Path) -> None:
    row = "0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + "\t".join(["deadbeef"] * 26) + "\n"
    whole = gzip.compress((row * 3000).encode())
    truncated = tmp_path / "day_0.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    result = dlrm("ingest", str(truncated), "--warehouse", str(tmp_path / "wh"))
    assert result.returncode == 1
    assert result.stderr.count("truncated gzip") == 1, result.stderr
    assert result.stderr.startswith("dlrm: error: ")
    assert not (tmp_path / "wh" / "_tmp").exists()


def test_the_embedded_default_config_is_found_from_any_folder(tmp_path: Path) -> None:
    line = _one_line_error(dlrm("plan", cwd=tmp_path))
    assert "no tables to plan" in line and "config file not found" not in line


def test_a_config_saved_with_a_bom_reads_as_utf8(tmp_path: Path) -> None:
    from flows.run.config import ConfigError, load_config

    config = tmp_path / "bom.toml"
    config.write_bytes("\ufeffname = \"bom\"\n[training]\nbatch_size = 512\n".encode())
    loaded = load_config(config)
    assert (loaded.name, loaded.training.batch_size) == ("bom", 512)
    config.write_bytes(b"name = \"caf\xe9\"\n")  # Latin-1
    with pytest.raises(ConfigError, match="not UTF-8 text .* save it as UTF-8"):
        load_config(config)


def test_ingest_json_reconciles_and_reports_partial(tmp_path: Path) -> None:
    good = "0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + "\t".join(["deadbeef"] * 26)
    (tmp_path / "day_0.gz").write_bytes(gzip.compress(((good + "\n") * 5 + "oops\n").encode()))
    (tmp_path / "day_1.gz").write_bytes(gzip.compress(((good + "\n") * 3000).encode())[:200])
    result = dlrm("ingest", str(tmp_path / "day_0.gz"), str(tmp_path / "day_1.gz"), "--warehouse", str(tmp_path / "wh"), "--json")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rows_read"] == report["rows_written"] + report["rows_quarantined"] == 6
    assert report["rows_quarantined"] == 1
    assert report["partial"] is True and "day_1.gz" in report["files_failed"][0]
    assert result.returncode == 1


def test_ingest_multi_hot_stores_bags_and_names_a_bad_feature(tmp_path: Path) -> None:
    line = "1\t" + "\t".join(["3"] * 13) + "\t0a1b2c3d,0000000f\t" + "\t".join(["deadbeef"] * 25)
    (tmp_path / "day_0.tsv").write_text(line + "\n")
    result = dlrm("ingest", str(tmp_path / "day_0.tsv"), "--warehouse", str(tmp_path / "wh"), "--multi-hot", "C1", "--json")
    assert json.loads(result.stdout.strip().splitlines()[-1])["rows_written"] == 1, result.stderr
    assert pq.read_table(tmp_path / "wh" / "day=0")["C1"].to_pylist() == [[0x0A1B2C3D, 0x0F]]
    bad = _one_line_error(dlrm("ingest", str(tmp_path / "day_0.tsv"), "--warehouse", str(tmp_path / "wh"),
                               "--multi-hot", "C1,C99"))
    assert "--multi-hot: ['C99'] are not categorical features" in bad


@pytest.mark.slow
def test_plan_of_scaled_m3_on_a_declared_gpu_cluster() -> None:
    result = dlrm("plan", "--config", "configs/m3-scaled.toml", "--cluster", "configs/clusters/h100-2x8.toml", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "WARNING" not in result.stderr and "Warning" not in result.stderr, "no planner notices: " + result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tables"] == 127 and report["embedding_gib"] > 1000, "far larger than one 80 GB GPU"
    assert len(report["per_rank"]) == 16
    largest = [f"t_f{i:03d}" for i in range(5)]
    assert set(largest) <= set(report["host_memory_tables"]), "the largest tables live in host memory"
    assert report["row_wise_tables"], "some tables are split row-wise"
    assert all(rank["hbm_bytes"] <= 80 * 2**30 for rank in report["per_rank"])


def test_plan_without_tables_is_a_one_line_error(tmp_path: Path) -> None:
    line = _one_line_error(dlrm("plan", "--config", "configs/tiny.toml", "--set", f'run_dir="{tmp_path}"'))
    assert "model.declared_tables: no tables to plan" in line


def test_stage_commands_chain_generate_ingest_preprocess(tmp_path: Path) -> None:
    run_dir = f'run_dir="{tmp_path}"'
    assert dlrm("generate", "--config", "configs/tiny.toml", "--set", run_dir).returncode == 0
    raw = sorted(str(p) for p in (tmp_path / "raw").glob("day_*.tsv.gz"))
    ingested = dlrm("ingest", *raw, "--warehouse", str(tmp_path / "warehouse"), "--json")
    assert json.loads(ingested.stdout.strip().splitlines()[-1])["rows_written"] == 18_000
    result = dlrm("preprocess", "--config", "configs/tiny.toml", "--set", run_dir, "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["train_rows"] == 12_000 and len(report["table_sizes"]) == 26
    for folder in report["days"].values():
        assert pq.read_table(sorted(Path(folder).glob("*.parquet")), partitioning=None).num_rows == 6000


def test_preprocess_before_ingest_is_a_one_line_error(tmp_path: Path) -> None:
    line = _one_line_error(dlrm("preprocess", "--config", "configs/tiny.toml", "--set", f'run_dir="{tmp_path}"'))
    assert "no Parquet" in line and "ingest that day first" in line


def test_an_empty_day_is_refused_in_one_line_unless_allowed(tmp_path: Path) -> None:
    empty = tmp_path / "day_0.gz"
    empty.write_bytes(gzip.compress(b""))
    warehouse = tmp_path / "wh"
    refused = dlrm("ingest", str(empty), "--warehouse", str(warehouse))
    assert refused.returncode == 2
    assert "day 0: no lines in" in _one_line_error(refused) and "--allow-empty" in refused.stderr
    assert not (warehouse / "day=0").exists() and not (warehouse / "_tmp").exists(), "nothing published or left"
    allowed = dlrm("ingest", str(empty), "--warehouse", str(warehouse), "--allow-empty", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout.splitlines()[-1])["rows_written"] == 0
    assert (warehouse / "day=0").is_dir() and "empty partition" in allowed.stderr


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_a_prefect_server_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    # a database the server cannot open: it exits before answering
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path}/missing/folder/prefect.db"}  # fmt: skip
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([*warm_commands.dlrm(), "run", "--config", str(ROOT / "configs" / "tiny.toml"),
                           "--set", f'run_dir="{tmp_path / "run"}"'], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180, check=False)  # fmt: skip
    errors = [x for x in done.stderr.splitlines() if x.startswith("dlrm: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, "the server's own traceback goes to its log"
    assert "Prefect server exited with code" in errors[0] and "PREFECT_API_URL" in errors[0]
    assert "Traceback" in (tmp_path / "prefect" / "temporary-server.log").read_text(), "named in the line"


def test_train_without_prepared_features_or_endpoint_is_one_line(tmp_path: Path) -> None:
    tiny = str(ROOT / "configs" / "tiny.toml")
    missing = _one_line_error(dlrm("train", "--config", tiny, "--set", f"run_dir={tmp_path}"))
    assert "run `dlrm preprocess --config …` (or `dlrm run`)" in missing
    endpoint = _one_line_error(dlrm("train", "--config", tiny, "--set", f"run_dir={tmp_path}", "--nnodes", "2"))
    assert "--nnodes > 1 needs --rdzv-endpoint" in endpoint
    rank = _one_line_error(dlrm("train", "--config", tiny, "--nnodes", "2", "--node-rank", "2",
                                "--rdzv-endpoint", "10.0.0.1:29400"))  # fmt: skip
    assert "--node-rank: must be in 0..1" in rank
    hosts = _one_line_error(dlrm("run", "--config", tiny, "--set", f"run_dir={tmp_path}",
                                 "--set", 'training.torchrun_args=["--nnodes=2"]'))  # fmt: skip
    assert "run `dlrm train --nnodes N" in hosts
