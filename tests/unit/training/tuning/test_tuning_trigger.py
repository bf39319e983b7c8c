"""Each trigger policy does what it says."""

import dataclasses
import math

import pytest

from training.tuning.key import TuningKey
from training.tuning.study import TunedParams
from training.tuning.trigger import decide

KEY = TuningKey(2048, 2, 1, "cpu", "EPYC", 12)
CONFIGURED = {"training.embedding_lr": 0.05, "training.dense_lr": 0.001, "training.warmup_steps": 0}


def _tuned(key: TuningKey, lr: float, ne: float) -> TunedParams:
    params = {"training.embedding_lr": lr, "training.dense_lr": lr / 10, "training.warmup_steps": 40}
    return TunedParams(key, params, ne, trial_number=3, study_name=f"m.{key.fingerprint}")


SMALL_BATCH = _tuned(dataclasses.replace(KEY, global_batch_size=256), lr=0.1, ne=0.80)
OTHER_HARDWARE = _tuned(dataclasses.replace(KEY, device_type="cuda", device_model="H100"), lr=0.9, ne=0.79)


@pytest.mark.parametrize("policy", ["off", "retune_first", "scale_and_schedule"])
def test_a_tuned_key_always_trains_with_its_best(policy: str) -> None:
    exact = _tuned(KEY, lr=0.3, ne=0.78)
    worse = dataclasses.replace(exact, params={**exact.params, "training.embedding_lr": 0.01}, ne=0.9)
    decision = decide(policy, KEY, [SMALL_BATCH, worse, exact], CONFIGURED, "sqrt")
    assert decision.action == "use_tuned" and decision.params == exact.params and decision.source == exact
    assert not decision.schedule_retune and "was tuned" in decision.reason


def test_off_trains_with_the_configured_values() -> None:
    decision = decide("off", KEY, [SMALL_BATCH], CONFIGURED, "sqrt")
    assert decision.action == "configured" and decision.params == CONFIGURED and not decision.schedule_retune
    assert "never tuned" in decision.reason and "policy = off" in decision.reason


def test_retune_first_asks_for_a_retune_before_training() -> None:
    decision = decide("retune_first", KEY, [SMALL_BATCH], CONFIGURED, "sqrt")
    assert decision.action == "retune_first" and not decision.schedule_retune


def test_scale_and_schedule_scales_the_nearest_key_and_schedules_a_retune() -> None:
    decision = decide("scale_and_schedule", KEY, [OTHER_HARDWARE, SMALL_BATCH], CONFIGURED, "sqrt")
    assert decision.action == "scale_and_schedule" and decision.schedule_retune
    assert decision.source == SMALL_BATCH, "same hardware beats a better NE elsewhere"
    assert decision.params["training.embedding_lr"] == pytest.approx(0.1 * math.sqrt(8))
    assert decision.params["training.warmup_steps"] == 5
    assert "batch 256 → 2048" in decision.reason
    linear = decide("scale_and_schedule", KEY, [SMALL_BATCH], CONFIGURED, "linear")
    assert linear.params["training.embedding_lr"] == pytest.approx(0.8)


def test_scale_and_schedule_with_nothing_tuned_trains_configured_and_schedules() -> None:
    decision = decide("scale_and_schedule", KEY, [], CONFIGURED, "sqrt")
    assert decision.params == CONFIGURED and decision.schedule_retune and decision.source is None


def test_decision_tags_carry_the_decision_and_where_its_parameters_come_from() -> None:
    tags = decide("scale_and_schedule", KEY, [SMALL_BATCH], CONFIGURED, "sqrt").as_tags()
    assert "tuning.key" not in tags, "the run's key is the resolved run's (flows/run/resolve.py)"
    assert tags["tuning.decision"] == "scale_and_schedule" and "nearest tuned key" in tags["tuning.reason"]
    assert tags["tuning.params_from"] == f"{SMALL_BATCH.study_name}#3"


def test_characterize_then_retune_ports_to_hardware_no_key_was_tuned_on() -> None:
    new_hardware = dataclasses.replace(KEY, device_type="cuda", device_model="H200", memory_per_device_gb=141)
    decision = decide("characterize_then_retune", new_hardware, [SMALL_BATCH, OTHER_HARDWARE], CONFIGURED, "sqrt")
    assert decision.action == "characterize_then_retune" and decision.params == CONFIGURED
    assert "no key on its hardware was" in decision.reason


def test_characterize_then_retune_on_known_hardware_retunes_at_the_batch() -> None:
    decision = decide("characterize_then_retune", KEY, [SMALL_BATCH], CONFIGURED, "sqrt")
    assert decision.action == "retune_first" and "a key on its hardware was tuned" in decision.reason
    # the same devices with another worker layout are new hardware for the batch size
    wider = dataclasses.replace(KEY, world_size=8)
    assert decide("characterize_then_retune", wider, [SMALL_BATCH], CONFIGURED, "sqrt").action == "characterize_then_retune"
