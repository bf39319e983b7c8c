"""Before training: look up the coming run's tuning key and decide which hyperparameters it
trains with (the resolved run applies them: flows/run/resolve.py).

The decision and its reason go to the flow's log and to the run's MLflow tags. Under
`retune_first` the retune runs here, before training (under `characterize_then_retune` after
measuring the hardware's batch: flows/tuning/port.py); under `scale_and_schedule` a retune
flow run is created on the served `retune` deployment (or, when none is served, the log
says which command to run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from prefect.artifacts import create_markdown_artifact
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from flows.run.config import ConfigSource, PipelineConfig
from flows.run.feature_files import Features
from flows.run.resolve import ResolvedRun
from flows.stages.features import run_logger
from flows.stages.trainer_slots import waits_for
from flows.tuning.retune import run_retune
from training.tuning.space import params_of
from training.tuning.study import open_storage, tuned_keys
from training.tuning.trigger import TuningDecision, decide

# `dlrm serve` registers the retune flow under this deployment.
RETUNE_DEPLOYMENT = "retune/retune"


def choose_hyperparameters(lookup: ResolvedRun, features: Features, source: ConfigSource,
                           lookup_at: Callable[[int], ResolvedRun] | None = None) -> TuningDecision:  # fmt: skip
    """The decision for the run `lookup` resolves to before tuning (its key names the batch
    and workers it would train with): a tuned key's best, the nearest key's scaled, a retune
    first, the port workflow, or the configured values; a retune scheduled when the policy
    says so. `lookup_at(batch)`: the same run resolved at another global batch (the port
    workflow trains at the hardware's)."""
    config, log = lookup.config, run_logger("flows.tuning.hyperparameters")
    storage = open_storage(config.optuna_storage, config.tuning.heartbeat_s)
    configured = params_of(config.training, config.model, config.tuning)
    decision = decide(config.tuning.policy, lookup.key, tuned_keys(storage, config.name), configured,
                      config.tuning.scaling_rule)  # fmt: skip
    log.info("tuning: %s", decision.reason)
    if decision.action == "retune_first":
        result = run_retune(lookup, features)
        if result.best is None:
            log.warning("tuning: the retune finished no trial; training with the configured values")
        else:
            decision = dataclasses.replace(
                decision, params=result.best.params, source=result.best,
                reason=f"{decision.reason}; {result.decision or f'retuned to NE {result.best.ne:.5f}'}",
            )  # fmt: skip
    if decision.action == "characterize_then_retune":
        from flows.tuning.port import port_decision

        decision = port_decision(decision, lookup, lookup_at or (lambda batch: lookup), features, configured)
    if decision.schedule_retune:
        scheduled = schedule_retune(config, source)
        decision = dataclasses.replace(decision, reason=f"{decision.reason} ({scheduled})")
    _publish(decision)
    return decision


def schedule_retune(config: PipelineConfig, source: ConfigSource) -> str:
    """Create a `retune` flow run on the served deployment; say what happened and when the
    retune will train (after this run's training: flows/stages/trainer_slots.py)."""
    log = run_logger("flows.tuning.hyperparameters")
    config_path, overrides = source.path, list(source.overrides)
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

