"""The promotion rule: a candidate must be good in its own right, then better than the champion.

Good in its own right: on its evaluation rows its NE is below the constant click rate's and
the logistic-regression reference's (by `reference_margin`), and its calibration is inside
a band. This holds for the first model too: "no champion yet" is no reason to promote a
model worse than predicting the click rate. Then, with a champion, the candidate must beat
the champion's NE on the same days by `margin`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from evaluation.config import EvaluationConfig


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reason: str
    candidate_ne: float
    champion_ne: float | None
    margin: float
    days: tuple[int | str, ...]  # as the config writes them
    champion_version: str | None = None
    # the quality gate's evidence, when it was given (see `QualityEvidence`)
    constant_ne: float | None = None
    reference_ne: float | None = None
    calibration: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QualityEvidence:
    """The candidate's references, all measured on the candidate's own evaluation rows."""

    constant_ne: float  # every row predicted at the training days' click rate
    reference_ne: float  # the logistic-regression reference
    calibration: float  # the candidate's Σ predictions / Σ labels


@dataclass(frozen=True)
class QualityGate:
    """Thresholds of the quality gate (`EvaluationConfig` holds them as settings)."""

    reference_margin: float = 0.0
    calibration_min: float = 0.9
    calibration_max: float = 1.1
    # the constant click rate always gates; the logistic regression unless this is off
    logistic_regression: bool = True

    @classmethod
    def from_config(cls, config: EvaluationConfig) -> QualityGate:
        return cls(config.reference_margin, config.calibration_min, config.calibration_max,
                   config.gate_on_logistic_regression)  # fmt: skip


# NEs this close (relative) are one model's, computed by different kernels: the workers score
# with the trainer's layers, the champion is re-scored from its exported model in the flow,
# and the same model's two NEs were seen 1e-9 apart, in either direction. Not an improvement.
SAME_NE = 1e-6


def quality_failure(candidate_ne: float, evidence: QualityEvidence, gate: QualityGate = QualityGate()) -> str | None:
    """Why the candidate is not good enough to promote, with the numbers; None if it is.

    NaN anywhere fails: a comparison with NaN is never true.
    """
    references = [("the constant predictor's", evidence.constant_ne)]
    if gate.logistic_regression:
        references.append(("the logistic regression's", evidence.reference_ne))
    for name, reference_ne in references:
        threshold = reference_ne * (1.0 - gate.reference_margin)
        # a model that is the reference (a wide part kept at the fitted regression) is not ahead of it
        if not candidate_ne < threshold * (1.0 - SAME_NE):
            margin = gate.reference_margin
            by = f" by the {100 * margin:.3f} % reference margin (< {threshold:.4f})" if margin else ""
            return f"NE {candidate_ne:.4f} is not below {name} {reference_ne:.4f}{by}"
    if not gate.calibration_min <= evidence.calibration <= gate.calibration_max:
        return f"calibration {evidence.calibration:.3f} is outside [{gate.calibration_min:.3f}, {gate.calibration_max:.3f}]"
    return None


def decide_promotion(
    candidate_ne: float,
    champion_ne: float | None,
    margin: float,
    days: tuple[int | str, ...],
    champion_version: str | None = None,
    *,
    evidence: QualityEvidence | None = None,
    gate: QualityGate = QualityGate(),
) -> PromotionDecision:
    """Refuse a candidate that fails the quality gate (`quality_failure`); otherwise promote
    when there is no champion, or when the candidate's NE on the same days is below the
    champion's by at least `margin` (relative: 0.001 means 0.1 % lower), and by more than
    float rounding (`SAME_NE`).

    Without `evidence` the gate is skipped: only for callers that cannot measure the
    references; the pipeline always passes them.
    """
    measured = {} if evidence is None else asdict(evidence)

    def decision(promote: bool, reason: str, champion: float | None) -> PromotionDecision:
        return PromotionDecision(promote, reason, candidate_ne, champion, margin, days, champion_version, **measured)

    failure = None if evidence is None else quality_failure(candidate_ne, evidence, gate)
    if failure is not None:
        return decision(False, failure, champion_ne)
    if champion_ne is None:
        return decision(True, "no champion yet", None)
    threshold = champion_ne * (1.0 - margin)
    gain = 100.0 * (champion_ne - candidate_ne) / champion_ne
    if champion_ne - candidate_ne > SAME_NE * champion_ne and candidate_ne <= threshold:
        reason = f"NE {candidate_ne:.5f} beats the champion's {champion_ne:.5f} by {gain:.3f} % (margin {100 * margin:.3f} %)"
        return decision(True, reason, champion_ne)
    reason = f"NE {candidate_ne:.5f} vs the champion's {champion_ne:.5f}: {gain:+.3f} %, short of the {100 * margin:.3f} % margin"
    return decision(False, reason, champion_ne)


def reference_line(label: str, model_ne: float, reference_ne: float, constant_ne: float | None) -> str:
    """One report line: a reference's NE and how the model compares with it.

    `constant_ne` is the constant click rate's NE on the same rows (None for the line of the
    constant itself). A reference no better than the constant says nothing about the model:
    no "% better" against it, whatever the numbers.

        logistic regression  0.8250   (model 5.68 % better)
        logistic regression  1.5141   (uninformative: worse than the constant 1.0007)
    """
    head = f"{label:<21}{reference_ne:.4f}   "
    if constant_ne is not None and not reference_ne < constant_ne:
        worse = "no better than" if reference_ne == constant_ne else "worse than"
        return head + f"(uninformative: {worse} the constant {constant_ne:.4f})"
    gain = 100.0 * (reference_ne - model_ne) / reference_ne
    if gain == 0.0:
        return head + "(model the same)"
    return head + f"(model {abs(gain):.2f} % {'better' if gain > 0 else 'worse'})"
