"""Before training: look up the coming run's tuning key and decide what it trains with.

The decision and its reason go to the flow's log and to the run's MLflow tags. Under
`retune_first` the retune runs here, before training; under `scale_and_schedule` a retune
flow run is created on the served `retune` deployment (or, when none is served, the log
says which command to run).
"""

from __future__ import annotations

import dataclasses

from prefect.artifacts import create_markdown_artifact
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from flows.config import PipelineConfig, trainer_cluster
from flows.features import Features
from flows.retune import run_logger, run_retune
from flows.trainer_slots import waits_for
from training.tuning.key import tuning_key
from training.tuning.space import Params, apply_params, params_of
from training.tuning.study import open_storage, tuned_keys
from training.tuning.trigger import TuningDecision, decide

# `dlrm serve` registers the retune flow under this deployment.
RETUNE_DEPLOYMENT = "retune/retune"


def choose_hyperparameters(
    config: PipelineConfig, features: Features, config_path: str, overrides: list[str]
) -> TuningDecision:
    log = run_logger("flows.tuning")
    key = tuning_key(config.training, config.orchestration.trainer_hosts, trainer_cluster(config))
    storage = open_storage(config.optuna_storage, config.tuning.heartbeat_s)
    configured = params_of(config.training, config.model, config.tuning)
    decision = decide(config.tuning.policy, key, tuned_keys(storage, config.name), configured,
                      config.tuning.scaling_rule)  # fmt: skip
    log.info("tuning: %s", decision.reason)
    if decision.action == "retune_first":
        result = run_retune(config, features)
        if result.best is None:
            log.warning("tuning: the retune finished no trial; training with the configured values")
        else:
            decision = dataclasses.replace(
                decision, params=result.best.params, source=result.best,
                reason=f"{decision.reason}; retuned to NE {result.best.ne:.5f} (trial #{result.best.trial_number})",
            )  # fmt: skip
    if decision.schedule_retune:
        scheduled = schedule_retune(config, config_path, overrides)
        decision = dataclasses.replace(decision, reason=f"{decision.reason} ({scheduled})")
    _publish(decision)
    return decision


def with_params(config: PipelineConfig, params: Params) -> PipelineConfig:
    training, model = apply_params(config.training, config.model, params)
    return dataclasses.replace(config, training=training, model=model)


def schedule_retune(config: PipelineConfig, config_path: str, overrides: list[str]) -> str:
    """Create a `retune` flow run on the served deployment; say what happened and when the
    retune will train (after this run's training: flows/trainer_slots.py)."""
    log = run_logger("flows.tuning")
    try:
        run = run_deployment(
            RETUNE_DEPLOYMENT, parameters={"config_path": config_path, "overrides": overrides},
            timeout=0, as_subflow=False,
        )  # fmt: skip
    except ObjectNotFound:
        command = " ".join(["dlrm retune --config", config_path, *(f"--set {o}" for o in overrides)])
        log.warning("tuning: no '%s' deployment is served (start one with `dlrm serve`); run `%s` to retune",
                    RETUNE_DEPLOYMENT, command)  # fmt: skip
        return f"no {RETUNE_DEPLOYMENT} deployment is served: run `{command}`"
    log.info("tuning: retune scheduled as flow run %s; %s", run.id, waits_for(config))
    return f"retune scheduled as flow run {run.id}; {waits_for(config)}"


def _publish(decision: TuningDecision) -> None:
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in decision.params.items())
    create_markdown_artifact(
        key="tuning-decision",
        markdown=f"## Tuning: {decision.action}\n\n{decision.reason}\n\n| parameter | value |\n|---|---|\n{rows}\n",
        description=f"Hyperparameters for tuning key {decision.key.fingerprint}",
    )

