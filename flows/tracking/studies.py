"""A study's MLflow runs: one parent run per study (created by its first worker), a child run
per trial with its parameters, its held-out NE as it trains and how it ended, and the
parent's summary (trial counts, the best trial, the study's plots) when a worker is done.
The study itself (Optuna) is tuning's (flows/tuning/retune.py, flows/tuning/trials.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from flows.tracking.runs import ensure_experiment, log_study_plots, tracking_client
from training.launch.processes import stops_held

# How a trial ended → the MLflow status of its run
TRIAL_ENDINGS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED", "stopped": "KILLED"}


def mlflow_param(name: str, value: Any) -> Param:
    return Param(name, str(value))


class StudyRuns:
    """The MLflow side of a study on one tracking server."""

    def __init__(self, tracking_uri: str) -> None:
        self.client = tracking_client(tracking_uri)

    def open_parent(self, experiment: str, artifact_location: str | None, study_name: str, tags: Mapping[str, str]) -> str:
        """A new parent run for the study; its id."""
        experiment_id = ensure_experiment(self.client, experiment, artifact_location)
        return self.client.create_run(experiment_id, run_name=f"retune-{study_name}", tags=dict(tags)).info.run_id

    def start_trial(self, parent: str, number: int, tags: Mapping[str, str], params: Mapping[str, Any]) -> TrialRun:
        """A trial's child run under `parent`, with its suggested parameters."""
        experiment_id = self.client.get_run(parent).info.experiment_id
        run = self.client.create_run(experiment_id, run_name=f"trial-{number}",
                                     tags={"mlflow.parentRunId": parent, "tuning.trial": str(number), **tags})  # fmt: skip
        trial = TrialRun(self.client, run.info.run_id)
        trial.log_params(params)
        return trial

    def end_parent(self, parent: str, failed: bool) -> None:
        """End the parent run of a worker that stopped (FAILED on an error, KILLED on Ctrl-C)."""
        self.client.set_terminated(parent, "FAILED" if failed else "KILLED")

    def finish_parent(self, parent: str, trial_states: list[str], best: BestTrial | None, study: Any) -> None:
        """The study's counts by state (`complete`, `pruned`, `fail`), its best trial and its
        plots on the parent run, which then ends."""
        for state in ("complete", "pruned", "fail"):
            self.client.log_metric(parent, f"trials_{state}", float(trial_states.count(state)))
        if best:
            self.client.log_metric(parent, "best_ne", best.ne)
            self.client.log_batch(parent, params=[mlflow_param(f"best.{k}", v) for k, v in best.params.items()])
            self.client.set_tag(parent, "tuning.best_trial", str(best.trial_number))
            self.client.log_dict(parent, {"best_ne": best.ne, "best_trial": best.trial_number, "params": best.params},
                                 "tuning/best.json")  # fmt: skip
        log_study_plots(self.client, parent, study)
        self.client.set_terminated(parent, "FINISHED")


@dataclass(frozen=True)
class BestTrial:
    ne: float
    trial_number: int
    params: dict[str, Any]


@dataclass(frozen=True)
class TrialRun:
    """One trial's run."""

    client: MlflowClient
    run_id: str

    # A stop (Ctrl-C) that lands in one of these writes waits for its end (stops_held): the
    # trial logs while its job trains, so that is where a stop most often finds it.
    def log_params(self, params: Mapping[str, Any]) -> None:
        with stops_held():
            self.client.log_batch(self.run_id, params=[mlflow_param(k, v) for k, v in params.items()])

    def log_metric(self, name: str, value: float, step: int | None = None) -> None:
        with stops_held():
            self.client.log_metric(self.run_id, name, value, step=step)

    def end(self, how: str) -> None:
        """`how`: a key of `TRIAL_ENDINGS`, tagged as `tuning.state`."""
        with stops_held():
            self.client.set_tag(self.run_id, "tuning.state", how)
            self.client.set_terminated(self.run_id, TRIAL_ENDINGS[how])
