import pytest

from evaluation.config import EvaluationConfig
from evaluation.promotion import (
    QualityEvidence,
    QualityGate,
    decide_promotion,
    quality_failure,
    reference_line,
)


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


GOOD = QualityEvidence(constant_ne=1.0007, reference_ne=0.8788, calibration=0.983)  # the demo's calibration


def test_a_first_model_worse_than_the_constant_is_not_promoted() -> None:
    evidence = QualityEvidence(constant_ne=1.0007, reference_ne=1.5141, calibration=1.0)
    decision = decide_promotion(1.0171, None, 0.0, (1,), evidence=evidence)
    assert not decision.promote
    assert decision.reason == "NE 1.0171 is not below the constant predictor's 1.0007"
    assert decision.constant_ne == 1.0007 and decision.reference_ne == 1.5141 and decision.calibration == 1.0


@pytest.mark.parametrize(
    "candidate, evidence, gate, refused_because",
    [
        (0.85, GOOD, QualityGate(), None),
        (1.0007, GOOD, QualityGate(), "not below the constant predictor's 1.0007"),  # equal is not below
        (float("nan"), GOOD, QualityGate(), "NE nan is not below the constant"),
        (0.90, GOOD, QualityGate(), "NE 0.9000 is not below the logistic regression's 0.8788"),
        (0.8788, GOOD, QualityGate(), "not below the logistic regression's"),
        # the regression itself, scored by other kernels (a wide model kept at its start)
        (0.8788 * (1 - 5e-10), GOOD, QualityGate(), "not below the logistic regression's"),
        (0.8788 * (1 - 1e-5), GOOD, QualityGate(), None),
        (0.8701, GOOD, QualityGate(reference_margin=0.01), "by the 1.000 % reference margin (< 0.8700)"),
        (0.8699, GOOD, QualityGate(reference_margin=0.01), None),
        (0.85, QualityEvidence(1.0, 0.88, 1.13), QualityGate(), "calibration 1.130 is outside [0.900, 1.100]"),
        (0.85, QualityEvidence(1.0, 0.88, 0.87), QualityGate(), "calibration 0.870 is outside"),
        (0.85, QualityEvidence(1.0, 0.88, 0.87), QualityGate(calibration_min=0.8), None),
        (0.85, QualityEvidence(1.0, 0.88, float("nan")), QualityGate(), "calibration nan is outside"),
        (0.90, GOOD, QualityGate(logistic_regression=False), None),  # the regression reported, not gating
        (1.0007, GOOD, QualityGate(logistic_regression=False), "not below the constant predictor's"),
    ],
)
def test_the_gate_needs_both_references_beaten_and_a_calibrated_model(candidate, evidence, gate, refused_because) -> None:
    failure = quality_failure(candidate, evidence, gate)
    assert (failure is None) is (refused_because is None)
    if refused_because:
        assert refused_because in failure
    decision = decide_promotion(candidate, None, 0.0, (2,), evidence=evidence, gate=gate)
    assert decision.promote is (refused_because is None)
    assert decision.reason == (failure or "no champion yet")


def test_the_gate_comes_before_the_champion_comparison() -> None:
    bad = QualityEvidence(constant_ne=0.70, reference_ne=0.75, calibration=1.0)  # both references beat 0.72
    decision = decide_promotion(0.72, 0.80, 0.0, (2,), "3", evidence=bad)
    assert not decision.promote and "constant" in decision.reason
    assert decision.champion_ne == 0.80 and decision.champion_version == "3"
    # passing the gate, the champion comparison decides as before
    assert decide_promotion(0.79, 0.80, 0.0, (2,), "3", evidence=GOOD).promote
    kept = decide_promotion(0.80, 0.79, 0.0, (2,), "3", evidence=GOOD)
    assert not kept.promote and "short of the" in kept.reason


def test_the_gate_takes_its_thresholds_from_the_evaluation_config() -> None:
    gate = QualityGate.from_config(EvaluationConfig(reference_margin=0.002, calibration_min=0.8, calibration_max=1.25))
    assert gate == QualityGate(0.002, 0.8, 1.25)
    assert QualityGate.from_config(EvaluationConfig()) == QualityGate()
    assert not QualityGate.from_config(EvaluationConfig(gate_on_logistic_regression=False)).logistic_regression


@pytest.mark.parametrize(
    "settings",
    [
        {"reference_margin": -0.1},
        {"reference_margin": 1.0},
        {"calibration_min": 0.0},
        {"calibration_min": 1.05},
        {"calibration_max": 0.95},
        {"reference_folds": -1},
    ],
)
def test_invalid_gate_settings_are_refused(settings: dict) -> None:
    key = next(iter(settings))
    with pytest.raises(ValueError, match=key):
        EvaluationConfig(**settings)


@pytest.mark.parametrize(
    "model, reference, constant, line",
    [
        (0.7781, 0.8250, 1.0000, "logistic regression  0.8250   (model 5.68 % better)"),
        (0.8500, 0.8250, 1.0000, "logistic regression  0.8250   (model 3.03 % worse)"),
        (0.9000, 1.5141, 1.0007, "logistic regression  1.5141   (uninformative: worse than the constant 1.0007)"),
        (0.9000, 1.0007, 1.0007, "logistic regression  1.0007   (uninformative: no better than the constant 1.0007)"),
        (0.7781, 1.0000, None, "constant click rate  1.0000   (model 22.19 % better)"),
    ],
)
def test_report_line_never_claims_a_gain_over_an_uninformative_reference(model, reference, constant, line) -> None:
    label = "constant click rate" if constant is None else "logistic regression"
    assert reference_line(label, model, reference, constant) == line
