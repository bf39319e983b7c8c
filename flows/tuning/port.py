"""The port workflow (`tuning.policy = "characterize_then_retune"`, `dlrm port`): on hardware
no key was tuned on, measure where its throughput saturates, retune at that batch, then
train; the summary says what the move cost in NE (training/tuning/port.py).

The characterization runs where the flow runs, with `training.nproc` processes: on the
trainer hosts' kind of hardware when the flow runs on one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flows.characterize.sweeps import Series
from flows.run.config import PipelineConfig
from flows.run.feature_files import Features
from flows.run.resolve import ResolvedRun
from flows.stages.features import run_logger
from flows.tracking.runs import newest_run_of_key
from flows.tuning.retune import run_retune
from training.loop.progress import read_records
from training.tuning.port import PortFacts, seconds_to_reach
from training.tuning.space import Params
from training.tuning.study import TunedParams, open_storage, tuned_keys
from training.tuning.trigger import TuningDecision, same_hardware


def with_batch(config: PipelineConfig, batch: int) -> PipelineConfig:
    """`config` at the hardware's batch, which its retune keeps (it searches no other batch:
    the point of the port is to train at the batch this hardware runs well)."""
    return dataclasses.replace(config, training=dataclasses.replace(config.training, batch_size=batch),
                               tuning=dataclasses.replace(config.tuning, batch_sizes=()))  # fmt: skip


def port_decision(decision: TuningDecision, lookup: ResolvedRun, lookup_at: Callable[[int], ResolvedRun],
                  features: Features, configured: Params) -> TuningDecision:  # fmt: skip
    """Characterize, then retune at the hardware's batch (unless that key is tuned already):
    the decision trains at that batch with the retune's best."""
    from flows.characterize.measure import characterize

    log = run_logger("flows.tuning.port")
    config = lookup.config
    storage = open_storage(config.optuna_storage, config.tuning.heartbeat_s)
    tuned_before = tuned_keys(storage, config.name)
    report = characterize([Series({}, config)], [], last_batch=config.tuning.characterize_max_batch or None,
                          on_line=lambda line: log.info("characterize: %s", line))  # fmt: skip
    batch = report.hardware_batch_size or config.training.batch_size
    log.info("port: this hardware's batch is %s (%s); retuning at it", f"{batch:,}",
             "where throughput saturates" if report.saturated else "the largest measured")  # fmt: skip
    at_batch = lookup_at(batch)
    best = next((t for t in tuned_before if t.key == at_batch.key), None)
    if best is None:
        best = run_retune(at_batch, features).best
    nearest = _nearest_elsewhere(at_batch, tuned_before)
    rate = next((p["samples_per_s"] for p in report.points if p["batch_size"] == report.hardware_batch_size), 0.0)
    facts = PortFacts(
        hardware_batch_size=batch, saturated=report.saturated, characterize_run_id=report.mlflow_run_id,
        hardware_samples_per_s=rate, nearest_key=nearest.key.fingerprint if nearest else "",
        nearest_batch=nearest.key.global_batch_size if nearest else 0, nearest_ne=nearest.ne if nearest else None,
        retuned_ne=best.ne if best else None,
    )  # fmt: skip
    gap = f"; NE gap against key {facts.nearest_key} at batch {facts.nearest_batch:,}: {facts.ne_gap:+.5f} " \
          f"({facts.ne_gap_percent:+.2f} %)" if facts.ne_gap is not None else ""  # fmt: skip
    params = {**(best.params if best else configured), "training.batch_size": batch}
    reason = (f"{decision.reason}; hardware batch {batch:,}, "
              + (f"retuned to NE {best.ne:.5f}" if best else "no trial finished: the configured values") + gap)  # fmt: skip
    return dataclasses.replace(decision, key=at_batch.key, params=params, source=best, port=facts, reason=reason)


def _nearest_elsewhere(run: ResolvedRun, tuned: list[TunedParams]) -> TunedParams | None:
    others = [t for t in tuned if not same_hardware(t.key, run.key)]
    return min(others, key=lambda t: (run.key.distance(t.key), t.ne)) if others else None


def port_summary(config: PipelineConfig, facts: PortFacts, metrics: Path) -> dict[str, Any]:
    """The facts with the time comparison: the nearest key's newest run (its final held-out
    NE and training time) against this run's time to reach that NE."""
    old = newest_run_of_key(config.tracking_uri, config.tracking.experiment, facts.nearest_key) if facts.nearest_key else None
    if old is not None:
        target, seconds = old
        facts = dataclasses.replace(facts, old_run_heldout_ne=target, old_run_seconds=seconds,
                                    seconds_to_old_ne=seconds_to_reach(read_records(metrics), target))  # fmt: skip
    return facts.as_dict()
