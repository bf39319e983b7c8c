"""Retuning in the flows: `retune_first` trains with the study's best; a trial scores the
mean NE of its seeds; a tuned key is reused; `scale_and_schedule` scales the nearest key
and creates a retune flow run; `off` keeps the configured values. Real trials (torchrun)
on the tiny config."""

import math
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client

from flows.run.config import load_config
from flows.stages.features import prepare_features
from flows.tuning.trials import validation_ne
from training.job import JobFolder
from training.tuning.key import tuning_key
from training.tuning.study import best_of, study_name

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def tuned_run(prefect_server, tmp_path_factory: pytest.TempPathFactory):
    """A pipeline run whose key was never tuned, under `retune_first` with 2 trials of 2 seeds."""
    from flows.deployments.pipeline import run_pipeline

    run_dir = tmp_path_factory.mktemp("retune-run")
    overrides = [f'run_dir="{run_dir}"', 'tuning.policy="retune_first"', "tuning.n_trials=2",
                 "tuning.seeds_per_trial=2", "tuning.sampler=\"tpe\""]  # fmt: skip
    summary = run_pipeline(CONFIG, overrides)
    return load_config(CONFIG, overrides), overrides, summary


def _study(config) -> optuna.Study:
    return optuna.load_study(study_name=study_name(config.name, tuning_key(config.training, config.workers)),
                             storage=config.optuna_storage)  # fmt: skip


def test_retune_first_trains_with_the_best_trial(tuned_run) -> None:
    config, _, summary = tuned_run
    study = _study(config)
    finished = [t for t in study.trials if t.state.is_finished() and t.state.name != "FAIL"]
    assert len(finished) == 2
    decision = study.user_attrs["decision"]
    assert summary["tuning_decision"] == "retune_first" and decision["verdict"] in summary["tuning_reason"]
    run = MlflowClient(config.tracking_uri).get_run(summary["mlflow_run_id"])
    assert decision["trial"] == study.best_trial.number, "the best trial was judged against the configured values"
    chosen = decision["configured_params"] if decision["kept_configured"] else study.best_params
    for name, value in chosen.items():
        logged = run.data.params[name]
        assert (float(logged) == pytest.approx(value)) if isinstance(value, float) else logged == str(value), name
    assert run.data.tags["tuning.key"] == tuning_key(config.training, config.workers).fingerprint
    assert run.data.tags["tuning.decision"] == "retune_first"
    # the seeds' spread of the trial the parameters come from (2 seeds a trial), in the
    # summary and MLflow; the configured values, when kept, were not measured over seeds
    if decision["kept_configured"]:
        assert summary["seed_spread"] is None and "seed_spread" not in run.data.metrics
    else:
        per_seed = list(study.best_trial.user_attrs["ne_per_seed"].values())
        spread = (max(per_seed) - min(per_seed)) / min(per_seed)
        assert summary["seed_spread"] == pytest.approx(spread) and summary["seed_spread_seeds"] == 2
        assert run.data.metrics["seed_spread"] == pytest.approx(spread)


def test_a_trial_scores_the_mean_ne_of_its_seeds(tuned_run) -> None:
    config, _, _ = tuned_run
    study = _study(config)
    client = MlflowClient(config.tracking_uri)
    children = {c.data.tags["tuning.trial"]: c for c in client.search_runs(
        [client.get_run(study.user_attrs["mlflow_parent_run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{study.user_attrs['mlflow_parent_run_id']}'")}  # fmt: skip
    seeds = [str(config.training.seed), str(config.training.seed + 1)]
    for trial in (t for t in study.trials if t.state.name == "COMPLETE"):
        per_seed = trial.user_attrs["ne_per_seed"]
        assert sorted(per_seed) == sorted(seeds)
        # Seeds change the initialisation and the shuffle, so the runs differ ...
        assert per_seed[seeds[0]] != per_seed[seeds[1]]
        # ... and the trial's value is their mean, each recomputed from its own predictions.
        trial_dir = config.path("tuning") / study.study_name / f"trial-{trial.number:04d}"
        recomputed = [validation_ne(JobFolder(trial_dir / f"seed-{s}")) for s in seeds]
        assert recomputed == pytest.approx([per_seed[s] for s in seeds], abs=1e-9)
        assert trial.value == pytest.approx(sum(recomputed) / 2, abs=1e-9)
        metrics = children[str(trial.number)].data.metrics
        assert metrics["ne"] == pytest.approx(trial.value)
        assert metrics[f"ne.seed_{seeds[1]}"] == pytest.approx(per_seed[seeds[1]])


def test_the_study_is_tracked_as_a_parent_run_with_nested_trials(tuned_run) -> None:
    config, _, _ = tuned_run
    study = _study(config)
    client = MlflowClient(config.tracking_uri)
    parent = client.get_run(study.user_attrs["mlflow_parent_run_id"])
    assert parent.data.metrics["best_ne"] == pytest.approx(best_of(study).ne), "the best as judged"
    assert parent.data.tags["tuning.key"] == tuning_key(config.training, config.workers).fingerprint
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")  # fmt: skip
    assert len(children) == 2
    states = {c.data.tags["tuning.trial"]: c.data.tags["tuning.state"] for c in children}
    for trial in study.trials:
        assert states[str(trial.number)] == {"COMPLETE": "complete", "PRUNED": "pruned"}[trial.state.name]
    complete = [c for c in children if c.data.tags["tuning.state"] == "complete"]
    assert all(0 < c.data.metrics["ne"] < 1.2 for c in complete)
    assert all(c.data.params["training.embedding_lr"] for c in children)
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert "plots/optimization_history.png" in plots


@flow
def _decide(config_path: str, overrides: list[str]):
    from flows.run.config import ConfigSource
    from flows.run.resolve import resolve_run
    from flows.tuning.hyperparameters import choose_hyperparameters

    config = load_config(config_path, overrides)
    features = prepare_features(config)
    return choose_hyperparameters(resolve_run(config, state=features.state), features,
                                  ConfigSource(config_path, tuple(overrides)))  # fmt: skip


def test_a_tuned_key_reuses_its_best_without_a_new_study(tuned_run) -> None:
    config, overrides, _ = tuned_run
    trials_before = len(_study(config).trials)
    decision = _decide(CONFIG, overrides)
    assert decision.action == "use_tuned" and decision.params == best_of(_study(config)).params
    assert len(_study(config).trials) == trials_before


def test_scale_and_schedule_scales_the_nearest_key_and_creates_a_retune_run(tuned_run) -> None:
    from flows.tuning.retune import retune

    config, overrides, _ = tuned_run
    deployment_id = retune.to_deployment(name="retune").apply()  # what `dlrm serve` registers
    bigger = [*overrides, 'tuning.policy="scale_and_schedule"', "training.batch_size=1024"]
    decision = _decide(CONFIG, bigger)
    best = best_of(_study(config)).params
    assert decision.action == "scale_and_schedule" and decision.source is not None
    # 1,024 would train 12 steps on 12,000 rows (min_steps 20): the run, and so its key, is at batch 512
    assert decision.key.global_batch_size == 512
    assert decision.params["training.embedding_lr"] == pytest.approx(best["training.embedding_lr"] * math.sqrt(2))
    assert "scheduled as flow run" in decision.reason

    async def runs():
        async with get_client() as client:
            return await client.read_flow_runs()

    import asyncio

    scheduled = [r for r in asyncio.run(runs()) if r.deployment_id == deployment_id]
    assert len(scheduled) == 1 and scheduled[0].parameters["overrides"] == bigger
    assert scheduled[0].state.is_scheduled()


def test_off_keeps_the_configured_values(tuned_run) -> None:
    config, overrides, _ = tuned_run
    decision = _decide(CONFIG, [*overrides, 'tuning.policy="off"', "training.batch_size=512"])
    assert decision.action == "configured"
    assert decision.params["training.embedding_lr"] == config.training.embedding_lr


def test_a_search_space_that_cannot_beat_the_configured_values_keeps_them(prefect_server, tmp_path) -> None:
    """Learning rates a hundred times too small: the trial finishes (nothing prunes it here)
    but loses to the configured values, so the key's tuned values are the configured ones.
    Scored on 2 folds: each trial and each side of the verdict trains once per fold, and the
    verdict pairs every fold's rows."""
    from flows.tuning.retune import retune
    from training.tuning.study import open_storage, tuned_keys

    overrides = [f'run_dir="{tmp_path}"', "tuning.n_trials=1", "tuning.embedding_lr=[0.0001, 0.0002]",
                 "tuning.dense_lr=[0.00001, 0.00002]", "tuning.prune_after_pct=99", 'tuning.sampler="tpe"',
                 "tuning.validation_folds=2"]  # fmt: skip
    result = retune(CONFIG, overrides)
    config = load_config(CONFIG, overrides)
    (trial,) = _study(config).trials
    folds = trial.user_attrs["ne_per_fold"]
    assert sorted(folds) == ["0", "1"] and trial.value == pytest.approx(sum(folds.values()) / 2)
    trial_dir = config.path("tuning") / _study(config).study_name / "trial-0000"
    fold_rows = [JobFolder(trial_dir / f"fold-{f}").read_predictions().labels.size for f in (0, 1)]
    assert all(rows > 0 for rows in fold_rows)
    assert _study(config).user_attrs["decision"]["rows"] == sum(fold_rows), "the verdict pairs both folds' rows"
    assert result["decision"].startswith("kept the configured values: NE "), result["decision"]
    assert "paired bootstrap over" in result["decision"]
    assert result["best_trial"] == -1 and result["best_params"]["training.embedding_lr"] == config.training.embedding_lr
    [tuned] = tuned_keys(open_storage(config.optuna_storage, config.tuning.heartbeat_s), config.name)
    assert tuned.trial_number == -1 and tuned.params["training.dense_lr"] == config.training.dense_lr
    assert tuned.ne < min(t.value for t in _study(config).trials if t.value is not None), "better than every trial"


def test_the_port_workflow_characterizes_new_hardware_retunes_at_its_batch_then_trains(tuned_run, tmp_path) -> None:
    """`characterize_then_retune` on a declared new hardware key: the batch-size sweep (real
    jobs, here), a retune at the batch it chose, then the run; the summary has the decision
    and the NE gap against the key tuned on the old hardware."""
    from flows.deployments.pipeline import run_pipeline

    config, overrides, old_summary = tuned_run
    cluster = tmp_path / "new-hardware.toml"
    cluster.write_text('name = "new host"\nhosts = 1\ndevices_per_host = 2\ncompute_device = "cpu"\n'
                       'host_memory_gb = 24\ndevice_model = "a CPU host the study never saw"\n')  # fmt: skip
    # one point and one trial of one seed: what is checked is the chain, not the search
    ported = [*overrides, 'tuning.policy="characterize_then_retune"', "tuning.characterize_max_batch=512",
              "tuning.n_trials=1", "tuning.seeds_per_trial=1", f'orchestration.trainer_cluster="{cluster}"']  # fmt: skip
    summary = run_pipeline(CONFIG, ported)
    port = summary["port"]
    assert summary["tuning_decision"] == "characterize_then_retune"
    assert port["hardware_batch_size"] == 512 and not port["saturated"]  # 256 a process, the sweep's only point
    client = MlflowClient(config.tracking_uri)
    curve = client.get_run(port["characterize_run_id"])
    assert curve.data.tags["characterize.hardware_batch_size"] == str(port["hardware_batch_size"])
    assert curve.data.tags["tuning.key.device_model"] == "a CPU host the study never saw"
    # retuned at the hardware's batch (fitted by the run-length rule to tiny's 12,000 rows: 512)
    new_key = summary["tuning_key"]
    assert new_key != old_summary["tuning_key"] and summary["global_batch_size"] == 512
    new_study = optuna.load_study(study_name=f"{config.name}.{new_key}", storage=config.optuna_storage)
    assert [t for t in new_study.trials if t.state.is_finished()], "a retune ran at the new key"
    # the gap against the key tuned on the old hardware, at its own batch (256)
    assert port["nearest_key"] == old_summary["tuning_key"] and port["nearest_batch"] == 256
    assert port["nearest_ne"] == pytest.approx(best_of(_study(config)).ne)
    assert port["retuned_ne"] == pytest.approx(best_of(new_study).ne)
    assert port["ne_gap"] == pytest.approx(port["retuned_ne"] - port["nearest_ne"])
    assert "NE gap against key" in summary["tuning_reason"]
    # and the time comparison against that key's run
    old_run = client.get_run(old_summary["mlflow_run_id"])
    assert port["old_run_heldout_ne"] == pytest.approx(old_run.data.metrics["heldout_ne"])
    assert port["old_run_seconds"] == pytest.approx(old_run.data.metrics["train_seconds"])
