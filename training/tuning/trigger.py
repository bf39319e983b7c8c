"""What a run trains with, given its tuning key, the tuned keys and the policy.

A pure decision (no I/O): the flow looks up the tuned keys, calls `decide`, logs the
decision and its reason, and acts on it (runs the retune first, or schedules one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from training.tuning.key import TuningKey
from training.tuning.port import PortFacts
from training.tuning.space import Params, scale_params
from training.tuning.study import TunedParams

Action = Literal["use_tuned", "retune_first", "scale_and_schedule", "characterize_then_retune", "configured"]


@dataclass(frozen=True)
class TuningDecision:
    action: Action
    reason: str
    key: TuningKey
    params: Params  # what to train with (for `retune_first`: until the retune answers)
    source: TunedParams | None = None  # the tuned key the parameters come from
    schedule_retune: bool = False
    port: PortFacts | None = None  # `characterize_then_retune`: the hardware's batch and the NE gap

    def as_tags(self) -> dict[str, str]:
        """MLflow tags of the decision (the run's own key: `TuningKey.as_tags`)."""
        tags = {"tuning.decision": self.action, "tuning.reason": self.reason}
        if self.source is not None:
            tags["tuning.params_from"] = f"{self.source.study_name}#{self.source.trial_number}"
        return tags


def decide(
    policy: str, key: TuningKey, tuned: list[TunedParams], configured: Params, scaling_rule: str
) -> TuningDecision:
    exact = [t for t in tuned if t.key == key]
    if exact:
        best = min(exact, key=lambda t: t.ne)
        return TuningDecision(
            "use_tuned", f"key {key.fingerprint} was tuned: best trial #{best.trial_number} reached NE {best.ne:.5f}",
            key, best.params, best,
        )  # fmt: skip
    never = f"key {key.fingerprint} ({_describe(key)}) was never tuned"
    if policy == "off":
        return TuningDecision("configured", f"{never}; tuning.policy = off: training with the configured values",
                              key, configured)  # fmt: skip
    if policy == "characterize_then_retune":
        if any(same_hardware(t.key, key) for t in tuned):
            return TuningDecision("retune_first", f"{never}; a key on its hardware was tuned: retuning at batch "
                                  f"{key.global_batch_size} before training", key, configured)  # fmt: skip
        return TuningDecision("characterize_then_retune", f"{never} and no key on its hardware was: measuring the "
                              "batch size where its throughput saturates, then retuning at that batch", key,
                              configured)  # fmt: skip
    if policy == "retune_first":
        return TuningDecision("retune_first", f"{never}; tuning.policy = retune_first: retuning before training",
                              key, configured)  # fmt: skip
    if policy != "scale_and_schedule":
        raise ValueError(f"unknown tuning policy {policy!r}")
    if not tuned:
        return TuningDecision(
            "scale_and_schedule", f"{never} and no other key was tuned: training with the configured values; "
            "a retune is wanted", key, configured, None, schedule_retune=True,
        )  # fmt: skip
    nearest = min(tuned, key=lambda t: (key.distance(t.key), t.ne))
    scaled = scale_params(nearest.params, nearest.key.global_batch_size, key.global_batch_size, scaling_rule)
    reason = (
        f"{never}: training with the nearest tuned key {nearest.key.fingerprint} ({_describe(nearest.key)}), "
        f"learning rates scaled by the {scaling_rule} rule for batch {nearest.key.global_batch_size} → "
        f"{key.global_batch_size}; a retune is wanted"
    )
    return TuningDecision("scale_and_schedule", reason, key, scaled, nearest, schedule_retune=True)


def same_hardware(one: TuningKey, other: TuningKey) -> bool:
    """The same kind of device, memory and worker layout (the batch may differ)."""
    return one.hardware() == other.hardware() and (one.world_size, one.hosts) == (other.world_size, other.hosts)


def _describe(key: TuningKey) -> str:
    return (
        f"batch {key.global_batch_size}, {key.world_size} workers on {key.hosts} host(s), "
        f"{key.device_type} {key.device_model}, {key.memory_per_device_gb} GB"
    )
