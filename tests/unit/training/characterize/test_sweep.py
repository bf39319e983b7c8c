"""The batch-size sweep's stopping rule and the saturation point, on measured rates given by hand."""

from __future__ import annotations

import pytest

from training.characterize.measure import MeasuredPoint, SkippedPoint
from training.characterize.sweep import BatchRange, batch_sweep, hardware_batch, saturation_index


def point(batch: int, rate: float) -> MeasuredPoint:
    return MeasuredPoint(values={"training.batch_size": batch}, batch_size=batch, samples_per_s=rate,
                         samples_per_s_min=rate * 0.98, samples_per_s_max=rate * 1.02, windows=5,
                         peak_memory_mb=100.0, peak_memory_mb_per_rank=[100.0], measured_step_ms=batch / rate * 1000,
                         estimated_step_ms=0.1, breakdown_ms={}, profiled_step_ms=0.0, breakdown_timing="cpu",
                         device="cpu", world_size=1)  # fmt: skip


def test_saturation_is_the_first_point_that_the_next_doublings_each_beat_by_less_than_the_threshold() -> None:
    assert saturation_index([100, 180, 250, 260, 255], 0.05) == 2  # 260 and 255: each < 5 % over 250
    assert saturation_index([100, 180, 185, 300, 310, 312], 0.05) == 3  # 180 → 185 alone was noise: 300 followed
    assert saturation_index([100, 180, 250, 262.5, 250], 0.05) is None  # exactly 5 % still counts as rising
    assert saturation_index([100, 90, 95], 0.05) == 0  # doublings that lose throughput have saturated
    assert saturation_index([100, 90], 0.05) is None  # too few points after it to say
    assert saturation_index([100, 90], 0.05, patience=1) == 0


def test_the_sweep_measures_patience_points_past_saturation_then_stops() -> None:
    rates = {256: 100.0, 512: 190.0, 1024: 300.0, 2048: 310.0, 4096: 305.0, 8192: 400.0}
    asked: list[int] = []

    def measure(batch: int) -> MeasuredPoint:
        asked.append(batch)
        return point(batch, rates[batch])

    results = list(batch_sweep(measure, BatchRange(first=256, last=8192)))
    assert asked == [256, 512, 1024, 2048, 4096]
    chosen, saturated = hardware_batch([r for r in results if isinstance(r, MeasuredPoint)], 0.05)
    assert (chosen.batch_size, saturated) == (1024, True)


def test_one_flat_doubling_does_not_end_the_sweep() -> None:
    rates = {512: 100.0, 1024: 180.0, 2048: 182.0, 4096: 300.0, 8192: 305.0, 16384: 300.0}
    results = list(batch_sweep(lambda b: point(b, rates[b]), BatchRange(first=512, last=16384)))
    assert [r.batch_size for r in results] == [512, 1024, 2048, 4096, 8192, 16384]
    assert hardware_batch(results, 0.05)[0].batch_size == 4096  # type: ignore[arg-type, union-attr]


def test_a_curve_that_still_rises_at_the_last_batch_chooses_the_largest_and_says_so() -> None:
    results = list(batch_sweep(lambda b: point(b, float(b)), BatchRange(first=128, last=1024)))
    assert [r.batch_size for r in results] == [128, 256, 512, 1024]
    chosen, saturated = hardware_batch(results, 0.05)  # type: ignore[arg-type]
    assert (chosen.batch_size, saturated) == (1024, False)


def test_running_out_of_memory_ends_the_sweep_even_with_explicit_batches() -> None:
    def measure(batch: int):
        if batch >= 4096:
            return SkippedPoint({"training.batch_size": batch}, batch, "CUDA out of memory", out_of_memory=True)
        return point(batch, float(batch))

    results = list(batch_sweep(measure, BatchRange(first=1024, last=16384, explicit=(1024, 4096, 16384))))
    assert [r.batch_size for r in results] == [1024, 4096]
    assert isinstance(results[-1], SkippedPoint) and results[-1].out_of_memory


def test_explicit_batches_are_all_measured_whatever_the_curve() -> None:
    results = list(batch_sweep(lambda b: point(b, 100.0), BatchRange(first=64, last=256, explicit=(64, 128, 256))))
    assert [r.batch_size for r in results] == [64, 128, 256]


def test_a_point_refused_before_it_ran_ends_a_doubling_series() -> None:
    refused = SkippedPoint({}, 512, "sharding.compute_kernel = 'fused_uvm_caching' … needs CUDA")
    results = list(batch_sweep(lambda b: refused, BatchRange(first=512, last=4096)))
    assert results == [refused]


@pytest.mark.parametrize("first,last,gain,patience", [(0, 8, 0.05, 2), (16, 8, 0.05, 2), (8, 16, 1.0, 2), (8, 16, 0.05, 0)])
def test_a_bad_range_is_refused(first: int, last: int, gain: float, patience: int) -> None:
    with pytest.raises(ValueError):
        BatchRange(first=first, last=last, min_gain=gain, patience=patience)


def test_a_curve_that_turns_down_at_the_last_batch_has_its_knee_before() -> None:
    # this machine's demo curve: the sweep reached --max-batch before two flat doublings
    rates = {512: 26_554.0, 1024: 34_974.0, 2048: 50_610.0, 4096: 63_996.0, 8192: 61_262.0}
    results = list(batch_sweep(lambda b: point(b, rates[b]), BatchRange(first=512, last=8192)))
    assert len(results) == 5
    chosen, saturated = hardware_batch(results, 0.05)  # type: ignore[arg-type]
    assert (chosen.batch_size, saturated) == (4096, True)


def test_the_knee_is_the_smallest_batch_within_the_gain_of_the_best() -> None:
    points = [point(b, r) for b, r in ((1024, 100.0), (2048, 150.0), (4096, 176.0), (8192, 180.0), (16384, 170.0))]
    chosen, _ = hardware_batch(points, 0.05)
    assert chosen.batch_size == 4096  # 180 / 176 = 1.023: doubling past 4,096 buys less than 5 %
    chosen, _ = hardware_batch(points, 0.01)
    assert chosen.batch_size == 8192
