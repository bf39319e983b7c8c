"""Managed-collision ids end to end (`preprocess.categorical_mode = "managed"`) on
configs/drifting-ids.toml, whose ids each live 3 days: `dlrm backfill --from 3 --to 8` in
hash, vocabulary and managed mode with the same table size. Managed tables hold the live ids
and score best on the last nights; each night continues the last one's remapping; the
newest model serves the same remapping where the project is not installed; the remapping
survives checkpoints and changes of world size exactly. (At the config's 20,000 rows a day
and two processes: bench/id_churn.py, docs/managed-ids.md.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from beside import ended_on_failure, start
from foreign_python import champion_scores_elsewhere, raw_lines, run_predictions
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from ingestion.preprocess import PreprocessState
from training.job import JobFolder, TrainJob
from training.serving.own_rows import own_row_share

# the module fixture runs every night of three backfills before the first test: 6–10 minutes on 2
# cores, more than the suite's 600 s a test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
DRIFTING = str(ROOT / "configs" / "drifting-ids.toml")
MODES = ("managed", "hash", "vocab")
FIRST, LAST = 3, 8
# the test's scale: half the config's rows a day (measured: the same ranking); its 2 processes
# one pass of each night's rows, as these nights were measured: the test is about the ids'
# tables, not how long a night trains (test_small_real_data.py runs the default "auto")
SCALE = ["data.synthetic.rows_per_day=10000", "training.epochs=1"]


@pytest.fixture(scope="module")
def nights(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Each mode's backfill of nights 3–8: (its config, the nights' summaries). The three
    commands run side by side (a night mostly waits on its stages' processes and the Prefect
    server; their trainings take turns on the server's trainer slot)."""
    commands = {}
    for mode in MODES:
        run_dir = tmp_path_factory.mktemp(mode)
        overrides = [f'run_dir="{run_dir}"', f'preprocess.categorical_mode="{mode}"', *SCALE]
        arguments = ["backfill", "--config", DRIFTING, "--from", str(FIRST), "--to", str(LAST)]
        commands[mode] = (overrides, start(arguments, overrides, run_dir, prefect_server))
    with ended_on_failure([command for _, command in commands.values()]):
        return {mode: (load_config(DRIFTING, overrides), command.report(timeout=1400)["nights"])
                for mode, (overrides, command) in commands.items()}  # fmt: skip


def _ne_table(nights: dict[str, tuple]) -> str:
    rows = [f"night {'  '.join(f'{mode:>8}' for mode in MODES)}"]
    for i in range(LAST - FIRST + 1):
        rows.append(f"{nights[MODES[0]][1][i]['as_of']:>5} " + "  ".join(f"{nights[m][1][i]['eval_ne']:8.4f}" for m in MODES))
    return "\n".join(rows)


def test_managed_tables_score_best_on_the_last_three_nights(nights) -> None:
    table = _ne_table(nights)
    print(table)
    for i in range(LAST - FIRST - 2, LAST - FIRST + 1):
        ne = {mode: nights[mode][1][i]["eval_ne"] for mode in MODES}
        assert ne["managed"] < min(ne["hash"], ne["vocab"]), table


def test_managed_rows_hold_the_live_ids(nights) -> None:
    """Of the last day's id occurrences, managed tables give their own row to the most."""
    shares = {}
    for mode in MODES:
        config, _ = nights[mode]
        states = sorted(config.path(config.preprocess.features_dir).glob("*/state.json"), key=lambda p: p.stat().st_mtime)
        state = PreprocessState.load(states[-1])
        shares[mode] = own_row_share(mode, config.path("warehouse"), config.path("train") / "serving", state.buckets,
                                     list(range(LAST)), LAST)  # fmt: skip
    print({mode: f"{100 * share.occurrences:.1f} % ({100 * share.distinct:.1f} % of distinct)" for mode, share in shares.items()})
    assert shares["managed"].occurrences > max(shares["hash"].occurrences, shares["vocab"].occurrences), shares
    assert shares["managed"].occurrences > 0.8, shares


def test_a_night_continues_the_last_ones_remapping_and_is_judged_against_it(nights) -> None:
    config, managed = nights["managed"]
    first, second = managed[0], managed[1]
    assert second["warm_start_version"] == first["model_version"] and second["days_trained"] == [FIRST]
    assert 0.5 < second["champion_ne_same_days"] < second["baseline_constant_ne"]
    assert managed[-1]["eval_ne"] < managed[-1]["baseline_constant_ne"]
    # the last night's rounds, in the job's summary and the night's MLflow run
    trained = JobFolder(config.path("train")).read_summary()
    assert trained.managed_rounds >= 2 and trained.managed_restarted_rows > 0 and trained.managed_resident_ids > 0
    metrics = MlflowClient(config.tracking_uri).get_run(managed[-1]["mlflow_run_id"]).data.metrics
    assert metrics["managed_ids_resident"] == trained.managed_resident_ids
    # how much the tables churn: counted, and said (with the size that would hold the ids) when it is much
    assert 0 <= trained.managed_returned_ids <= trained.managed_admitted_ids and trained.managed_live_ids > 0
    assert metrics["managed_ids_returned"] == trained.managed_returned_ids
    churns = trained.managed_returned_ids >= 0.2 * trained.managed_admitted_ids
    assert managed[-1]["managed_churn"] == trained.managed_churn and bool(trained.managed_churn) == churns


def test_the_served_model_remaps_raw_lines_as_the_run_did_where_the_project_is_not(nights, tmp_path: Path) -> None:
    config, managed = nights["managed"]
    lines, expected = raw_lines(config, LAST), run_predictions(config, LAST)
    scores = champion_scores_elsewhere(config, lines, tmp_path, version=managed[-1]["model_version"])
    assert scores.shape == expected.shape == (len(lines),)
    assert np.abs(scores - expected).max() <= 1e-6



def _reshard(job_file: Path, checkpoint: Path, world: int, out: Path, save_to: Path | None = None) -> list[dict]:
    out.mkdir(parents=True)
    command = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", f"--nproc-per-node={world}",
               str(ROOT / "tests" / "integration" / "managed_reshard.py"), str(job_file), str(checkpoint), str(out),
               *([str(save_to)] if save_to else [])]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank-{rank}.pt") for rank in range(world)]


def test_the_remapping_survives_a_checkpoint_and_resharding_2_1_2_exactly(nights, tmp_path: Path) -> None:
    """The last night's checkpoint (2 processes) loaded into 1 process and saved as its warm
    start, that loaded into 2: every process holds the remapper the night ended with."""
    from training.serving.export import export_managed_ids

    config, _ = nights["managed"]
    folder = JobFolder(config.path("train"))
    job = TrainJob.load(folder.job_file())
    checkpoint = Path(folder.read_summary().checkpoint)
    assert job.workers.world_size == 2
    managed = export_managed_ids(job, checkpoint)
    assert managed is not None
    resident = {feature: len(managed.id_rows(feature)) for feature in managed.tables}
    assert all(count > 0 for count in resident.values()), resident
    reference = managed.state_dict()
    loaded = []
    for world, hop in ((1, "one"), (2, "two")):
        saves = tmp_path / f"{hop}-saved" if world == 1 else None
        loaded += _reshard(folder.job_file(), checkpoint, world, tmp_path / hop, saves)
        if saves is not None:
            [checkpoint] = [p for p in saves.iterdir() if p.name.startswith("step-")]
    assert len(loaded) == 3
    for state in loaded:
        assert state.keys() == reference.keys()
        for key, tensor in reference.items():
            assert torch.equal(state[key], tensor), key
