import pytest

from evaluation.promotion import decide_promotion


def test_first_model_is_promoted() -> None:
    decision = decide_promotion(0.8, None, 0.001, (2,))
    assert decision.promote and decision.reason == "no champion yet"


@pytest.mark.parametrize(
    "candidate, champion, margin, promote",
    [
        (0.79, 0.80, 0.0, True),
        (0.80, 0.80, 0.0, False),  # equal is not better
        (0.80 * (1 - 1e-9), 0.80, 0.0, False),  # the same NE to float rounding (other kernels)
        (0.80 * (1 - 1e-5), 0.80, 0.0, True),  # a real, if small, improvement
        (0.81, 0.80, 0.0, False),
        (0.7992, 0.80, 0.001, True),  # 0.1 % better: exactly the margin
        (0.7993, 0.80, 0.001, False),  # 0.0875 % better: short of it
    ],
)
def test_margin_is_relative_and_strict(candidate: float, champion: float, margin: float, promote: bool) -> None:
    decision = decide_promotion(candidate, champion, margin, (2, 3), champion_version="4")
    assert decision.promote is promote
    assert decision.champion_ne == champion and decision.days == (2, 3) and decision.champion_version == "4"
    assert ("beats" in decision.reason) is promote
