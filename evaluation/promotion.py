"""The promotion rule: a candidate replaces the champion only if it is better by a margin."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reason: str
    candidate_ne: float
    champion_ne: float | None
    margin: float
    days: tuple[int, ...]
    champion_version: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# NEs this close (relative) are one model's, computed by different kernels: the workers score
# with the trainer's layers, the champion is re-scored from its exported model in the flow,
# and the same model's two NEs were seen 1e-9 apart, in either direction. Not an improvement.
SAME_NE = 1e-6


def decide_promotion(
    candidate_ne: float,
    champion_ne: float | None,
    margin: float,
    days: tuple[int, ...],
    champion_version: str | None = None,
) -> PromotionDecision:
    """Promote when there is no champion, or when the candidate's NE on the same days is
    below the champion's by at least `margin` (relative: 0.001 means 0.1 % lower), and by
    more than float rounding (`SAME_NE`)."""
    if champion_ne is None:
        return PromotionDecision(True, "no champion yet", candidate_ne, None, margin, days, champion_version)
    threshold = champion_ne * (1.0 - margin)
    gain = 100.0 * (champion_ne - candidate_ne) / champion_ne
    if champion_ne - candidate_ne > SAME_NE * champion_ne and candidate_ne <= threshold:
        reason = f"NE {candidate_ne:.5f} beats the champion's {champion_ne:.5f} by {gain:.3f} % (margin {100 * margin:.3f} %)"
        return PromotionDecision(True, reason, candidate_ne, champion_ne, margin, days, champion_version)
    reason = f"NE {candidate_ne:.5f} vs the champion's {champion_ne:.5f}: {gain:+.3f} %, short of the {100 * margin:.3f} % margin"
    return PromotionDecision(False, reason, candidate_ne, champion_ne, margin, days, champion_version)
