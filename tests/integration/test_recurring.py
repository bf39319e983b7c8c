"""Recurring training on generated days 0–5: each night continues the champion on exactly
the days it has not seen, is judged on a day neither has trained on, and leaves its
lineage in the registry; a night already run trains nothing."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import warm_commands
from beside import ended_on_failure, start
from foreign_python import make_foreign_python, raw_lines
from mlflow.tracking import MlflowClient

from flows.run.config import load_config
from flows.run.reports import SkippedNight, run_report
from flows.tracking.lineage import TAG_AS_OF, TAG_CHECKPOINT, TAG_DAYS, TAG_PARENT, TAG_STATE

# the module fixture runs four nights and their rerun before the first test: 3–5 minutes on 2
# cores, near the suite's 600 s a test (a waiting night and the one after it add about a minute)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")


def sets(overrides: list[str]) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


def dlrm_command(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([*warm_commands.dlrm(), *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
ROWS_PER_DAY = 15_000  # 30,000 served calibrations 0.990–1.024 (2.4 % off at most); 15,000 0.989–1.019
NIGHTS = (2, 3, 4, 5)
# The tiny config with more ids (every day still teaches something). At a constant rate its
# calibration drifted by up to ±20 % from night to night, and nights were refused for it
# (docs/calibration.md); with the defaults (the rate decays within each run, a calibrator
# fitted on the held-out rows of the newest days) every night lands within 3 %.
# The dense part trains with Adam: with the config's Adagrad the warm-started nights lag a
# model trained from scratch (1.8 % on day 5, measured), its accumulated state leaving them
# little step size.
# The nights write delta checkpoints (training.checkpoint_mode): night 3's is a delta on night
# 2's kept checkpoint, which night 4 loads into one process through the chain.
# The first night's reference cross-validates (FIRST_NIGHT: the default on few rows, not
# tiny.toml's one slice), so it crosses the generator's pairs (`model.crosses`); the nights
# that continue it keep them and choose none, so their references keep tiny's one slice
# (five folds there cost the module about 20 s).
COMMON = [f"data.synthetic.rows_per_day={ROWS_PER_DAY}", "data.synthetic.cardinality_scale=0.004",
          "preprocess.hash_size=10000", 'training.dense_optimizer="adam"', "training.dense_lr=0.001",
          "training.embedding_lr=0.05", 'training.checkpoint_mode="delta"']  # fmt: skip
FIRST_NIGHT = ["evaluation.reference_folds=0"]


@pytest.fixture(scope="module")
def nights(prefect_server: str, tmp_path_factory: pytest.TempPathFactory):
    """Four nights, as of days 2 to 5 (as of day 4 on one process: the world size changes),
    then, as `dlrm` commands, 5 again and a backfill over 4–5. (How a chain's last night
    compares with a model trained from scratch on the same days is measured by
    bench/calibration_chain.py: docs/performance.md.)"""
    from flows.deployments.pipeline import run_pipeline

    run_dir = tmp_path_factory.mktemp("recurring")
    overrides = [f'run_dir="{run_dir}"', *COMMON, "tracking.registered_model=dlrm-recurring"]
    summaries = {}
    for as_of, extra in ((2, FIRST_NIGHT), (3, []), (4, ["training.nproc=1"]), (5, [])):
        summaries[as_of] = run_pipeline(TINY, [*overrides, *extra], str(as_of))
    # the nights already done, as a user reruns them: the last one, and a backfill over two
    again = tmp_path_factory.mktemp("again")
    rerun = start(["run", "--config", TINY, "--as-of", "5"], overrides, again, prefect_server, as_json=False, name="run")
    backfill = start(["backfill", "--config", TINY, "--from", "4", "--to", "5"], overrides, again, prefect_server,
                     name="backfill")  # fmt: skip
    with ended_on_failure([rerun, backfill]):
        summaries["5 again"], summaries["backfill 4–5"] = rerun.text(timeout=300), backfill.report(timeout=300)
    return load_config(TINY, overrides), summaries


def test_the_first_night_crosses_pairs_and_every_night_after_keeps_them(nights) -> None:
    """Night 2 (a fresh model) chooses pairs of features to cross; the nights that continue it
    cross the same ones (their checkpoints hold those tables), and so does the served model
    (the delta test below scores raw rows through it)."""
    _, summaries = nights
    first = summaries[2]["crosses"]
    assert first and all("_x_" in name for name in first), first
    for as_of in (3, 4, 5):
        assert summaries[as_of]["crosses"] == first, (as_of, summaries[as_of]["crosses"], first)


def test_each_night_trains_exactly_the_days_the_champion_has_not_seen(nights) -> None:
    _, summaries = nights
    first = summaries[2]
    assert first["days_trained"] == [0, 1] and first["warm_start_version"] is None
    assert first["rows_trained"] + first["calibration_rows"] == 2 * ROWS_PER_DAY and first["eval_days"] == [2]
    assert first["promoted"], first["promotion_reason"]
    for as_of in NIGHTS[1:]:
        night, before = summaries[as_of], summaries[as_of - 1]
        assert night["skipped"] is False and night["as_of"] == as_of
        assert night["days_trained"] == [as_of - 1], "one new day a night"
        # the calibrator's rows grow by the new day's held-out share: the rest of the day trains
        new_day_held_out = night["calibration_rows"] - before["calibration_rows"]
        assert night["rows_trained"] + new_day_held_out == ROWS_PER_DAY, "one day's rows a night"
        assert night["lineage_days"] == list(range(as_of))
        assert night["warm_start_version"] == summaries[as_of - 1]["model_version"]
        assert night["promoted"], f"night {as_of}: {night['promotion_reason']}"
    assert summaries[4]["world_size"] == 1 and summaries[3]["world_size"] == summaries[5]["world_size"] == 2


def test_every_night_serves_calibrated_probabilities_refitted_on_its_newest_days(nights) -> None:
    """Σ predictions / Σ clicks within 3 % on every evaluation day, under the default gate
    band; each night's calibrator is fitted on the held-out rows of the newest days its model
    has seen, so it grows with the lineage (10 % of each day)."""
    _, summaries = nights
    for summary in (summaries[as_of] for as_of in NIGHTS):
        assert 0.97 <= summary["eval_calibration"] <= 1.03, (summary["as_of"], summary["eval_calibration"])
        assert summary["calibrator"].startswith(("Platt scaling", "none ("))  # "none": found of no use
    held_out = [summaries[as_of]["calibration_rows"] for as_of in NIGHTS]
    assert held_out == sorted(held_out) and held_out[-1] > 2.2 * held_out[0], "days 0–1, then 0–2, … 0–4"
    assert 0.07 < held_out[0] / (2 * ROWS_PER_DAY) < 0.13


def test_a_night_already_run_is_skipped(nights) -> None:
    """`dlrm run --as-of 5` again prints its skipped line and exits 0; `dlrm backfill` over
    nights 4–5, both covered by the champion, reports both skipped (with the version and its NE)."""
    _, summaries = nights
    version = summaries[5]["model_version"]
    lines = [line for line in summaries["5 again"].splitlines() if line.strip()]
    assert lines[0] == (f"as of day 5: skipped: champion version {version} has trained on every day before 5 "
                        f"(lineage {list(range(5))}); nothing new to train"), lines  # fmt: skip
    assert lines[1] == f"  champion             version {version}, lineage days {list(range(5))}"
    four, five = summaries["backfill 4–5"]["nights"]
    assert four["skipped"] is True and four["as_of"] == 4 and four["model_version"] == version and four["eval_ne"] is None
    assert f"champion version {version} has trained on every day before 4" in four["skip_reason"]
    assert five["skipped"] is True and five["days_trained"] == [] and five["rows_trained"] == 0
    assert five["model_version"] == five["champion_version"] == version
    assert five["eval_ne"] == pytest.approx(summaries[5]["eval_ne"])
    assert "nothing new to train" in five["skip_reason"]


def test_the_last_night_beats_the_constant_baseline(nights) -> None:
    """The chain learns: the last night's model is ahead of predicting the training click
    rate (its NE against one trained from scratch: bench/calibration_chain.py)."""
    _, summaries = nights
    assert summaries[5]["eval_ne"] < summaries[5]["baseline_constant_ne"]


def test_the_registry_shows_the_chain(nights) -> None:
    config, summaries = nights
    client = MlflowClient(tracking_uri=config.tracking_uri)
    name = config.tracking.registered_model
    parent = ""
    for as_of in NIGHTS:
        version = client.get_model_version(name, summaries[as_of]["model_version"])
        assert version.tags[TAG_AS_OF] == str(as_of)
        assert version.tags[TAG_DAYS] == ",".join(map(str, range(as_of)))
        assert version.tags[TAG_PARENT] == parent
        assert version.tags[TAG_STATE]
        run_tags = client.get_run(version.run_id).data.tags
        assert run_tags[TAG_DAYS] == version.tags[TAG_DAYS]
        parent = str(version.version)
    champion = client.get_model_version_by_alias(name, "champion")
    assert str(champion.version) == summaries[5]["model_version"]
    kept = [p for p in config.path("lineage").iterdir() if not p.name.startswith(".")]
    assert [str(p) for p in kept] == [champion.tags[TAG_CHECKPOINT]], "only the champion's checkpoint is kept"


def test_a_night_on_the_same_world_size_writes_a_delta_on_the_checkpoint_it_continued(nights) -> None:
    """Night 3 continues night 2's model on two processes: its checkpoint holds the rows one day
    changed. Night 4 runs on one process, so it and night 5 (two again) start new chains."""
    _, summaries = nights
    written = {as_of: summaries[as_of]["checkpoint_bytes"] for as_of in NIGHTS}
    assert written[3] < 0.8 * written[2], written
    assert min(written[4], written[5]) > 0.9 * written[2], written
    assert summaries[4]["warm_start_version"] == summaries[3]["model_version"], "night 4 loaded the delta's chain"


SCORE_WITH_DELTA = """
import json, sys
import mlflow, numpy as np, pandas as pd
served, target = mlflow.pyfunc.load_model(sys.argv[1]), mlflow.pyfunc.load_model(sys.argv[2])
frame = pd.DataFrame({"line": json.load(open(sys.argv[3]))})
before = served.predict(frame)
served.unwrap_python_model().apply_delta(sys.argv[4])
np.save(sys.argv[5], np.stack([before, served.predict(frame), target.predict(frame)]))
"""


def test_the_served_model_of_one_night_plus_its_delta_scores_as_the_next_nights(nights, tmp_path: Path) -> None:
    """`dlrm export-delta` from night 2's version to night 3's: the changed rows, the MLPs and
    the calibration, which night 2's served model applies, in a Python that cannot import this
    project, to score day 4's raw rows as night 3's served model does."""
    config, summaries = nights
    overrides = [f'run_dir="{config.run_dir}"', *COMMON, "tracking.registered_model=dlrm-recurring"]
    before, after = summaries[2]["model_version"], summaries[3]["model_version"]
    delta = tmp_path / "delta"
    done = dlrm_command("export-delta", "--config", TINY, *sets(overrides), "--from-version", before,
                        "--to-version", after, "--out", str(delta), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < report["rows_changed"] < report["table_rows"] and report["dense_tensors"] > 0, report
    missing = dlrm_command("export-delta", "--config", TINY, *sets(overrides), "--from-version", "999",
                           "--to-version", after, "--out", str(tmp_path / "other"))  # fmt: skip
    assert missing.returncode == 2 and "version 999 of dlrm-recurring is not in the registry" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr

    python = make_foreign_python(tmp_path / "venv")
    (tmp_path / "lines.json").write_text(json.dumps(raw_lines(config, 4)[:3000]))
    (tmp_path / "score.py").write_text(SCORE_WITH_DELTA)
    name = config.tracking.registered_model
    subprocess.run([python, "score.py", f"models:/{name}/{before}", f"models:/{name}/{after}", "lines.json", str(delta),
                    "scores.npy"], cwd=tmp_path, check=True, timeout=300,
                   env={**os.environ, "MLFLOW_TRACKING_URI": config.tracking_uri, "PYTHONPATH": ""})  # fmt: skip
    served_before, served_with_delta, served_after = np.load(tmp_path / "scores.npy")
    assert np.abs(served_with_delta - served_after).max() <= 1e-6
    assert np.abs(served_before - served_after).max() > 1e-4, "the two versions score differently"


def test_a_version_that_continued_another_records_the_rows_it_changed(nights, tmp_path: Path) -> None:
    """Night 3's registered version says which table rows differ from night 2's (the version it
    continued): the same rows as the served delta between them finds by comparing the two,
    counted in its tag, its summary and its MLflow run. Night 2, a fresh model, records none."""
    import mlflow
    import pyarrow.parquet as pq

    from flows.tracking.lineage import TAG_ROWS_CHANGED

    config, summaries = nights
    client = MlflowClient(tracking_uri=config.tracking_uri)
    name = config.tracking.registered_model
    before, after = summaries[2]["model_version"], summaries[3]["model_version"]
    assert summaries[3]["warm_start_version"] == before
    assert summaries[2]["rows_changed"] is None and TAG_ROWS_CHANGED not in client.get_model_version(name, before).tags
    version = client.get_model_version(name, after)
    recorded = mlflow.artifacts.download_artifacts(artifact_uri=client.get_model_version_download_uri(name, after),
                                                   dst_path=str(tmp_path / "v"), tracking_uri=config.tracking_uri)  # fmt: skip
    rows = pq.read_table(next(Path(recorded).rglob("rows_changed.parquet"))).to_pylist()
    delta = tmp_path / "delta"
    overrides = [f'run_dir="{config.run_dir}"', *COMMON, "tracking.registered_model=dlrm-recurring"]
    done = dlrm_command("export-delta", "--config", TINY, *sets(overrides), "--from-version", before,
                        "--to-version", after, "--out", str(delta))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compared = pq.read_table(delta / "rows.parquet", columns=["table", "row"]).to_pylist()
    assert {(r["table"], r["row"]) for r in rows} == {(r["table"], r["row"]) for r in compared}
    assert 0 < len(rows) == summaries[3]["rows_changed"] == int(version.tags[TAG_ROWS_CHANGED])
    assert summaries[3]["rows_changed"] < summaries[3]["table_rows"]
    assert client.get_run(version.run_id).data.metrics["rows_changed"] == len(rows)


def test_a_night_with_too_few_new_rows_waits_and_the_next_trains_its_days_with_its_own(nights) -> None:
    """`orchestration.min_night_rows` above a day's rows: the night as of day 6 ingests day 5,
    trains nothing, registers nothing and says why; the night as of day 7 continues the same
    champion on days 5 and 6 together."""
    from flows.deployments.pipeline import run_pipeline

    config, summaries = nights
    overrides = [f'run_dir="{config.run_dir}"', *COMMON, "tracking.registered_model=dlrm-recurring",
                 f"orchestration.min_night_rows={ROWS_PER_DAY + 1}"]  # fmt: skip
    champion = summaries[5]["model_version"]
    client = MlflowClient(tracking_uri=config.tracking_uri)
    versions = len(client.search_model_versions(f"name='{config.tracking.registered_model}'"))
    waited = run_report(run_pipeline(TINY, overrides, "6"))
    assert isinstance(waited, SkippedNight) and waited.rows_trained == 0 and waited.model_version == champion
    assert waited.skip_reason.startswith(f"waiting for more rows: days [5] hold {ROWS_PER_DAY:,} new rows"), waited
    # the champion that keeps serving is judged on day 6, as a night judges what it serves
    assert waited.eval_ne is not None and 0.5 < waited.eval_ne < summaries[5]["baseline_constant_ne"]
    assert len(client.search_model_versions(f"name='{config.tracking.registered_model}'")) == versions
    night = run_pipeline(TINY, overrides, "7")
    assert night["skipped"] is False and night["days_trained"] == [5, 6] and night["eval_days"] == [7]
    assert night["warm_start_version"] == champion and night["lineage_days"] == list(range(7))
    assert 1.7 * ROWS_PER_DAY < night["rows_trained"] < 2 * ROWS_PER_DAY, "both days, less their held-out rows"


def test_a_nightly_run_takes_the_newest_complete_day(prefect_server, tmp_path: Path) -> None:
    """The nightly deployment's parameters (`as_of = "newest"`) on Criteo files landing in a
    folder: day 3 is still being written (no marker), so the night is as of day 2."""
    from flows.deployments.pipeline import pipeline
    from flows.deployments.serve import build_deployments
    from ingestion.synthetic import GroundTruth, generate_day

    logs = tmp_path / "logs"
    synthetic = load_config(TINY).data.synthetic
    truth = GroundTruth(synthetic)
    for day in (0, 1, 2, 3):
        generate_day(synthetic, day, logs, truth)
    for day in (0, 1, 2):
        (logs / f"day_{day}.tsv.gz.done").write_bytes(b"")
    overrides = [f'run_dir="{tmp_path / "run"}"', 'data.source="files"', f'data.files=["{logs}/day_*.tsv.gz"]',
                 'data.complete_marker="{file}.done"', "tracking.registered_model=dlrm-nightly"]  # fmt: skip
    (nightly, *_) = build_deployments(TINY, overrides)
    summary = pipeline(**nightly.parameters)
    assert nightly.parameters["as_of"] == "newest"
    assert summary["as_of"] == 2 and summary["eval_days"] == [2] and summary["days_trained"] == [0, 1]
    assert summary["rows_trained"] + summary["calibration_rows"] == 2 * synthetic.rows_per_day
    assert summary["warm_start_version"] is None
    # fired again before day 3 is complete: the same night, already done, read back as the command reads it
    again = run_report(pipeline(**nightly.parameters))
    assert isinstance(again, SkippedNight) and again.as_of == 2 and again.model_version == summary["model_version"]
    assert again.champion_version == (summary["model_version"] if summary["promoted"] else None)
    assert again.eval_ne == pytest.approx(summary["eval_ne"])
