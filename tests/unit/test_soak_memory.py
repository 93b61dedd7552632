"""The soak's memory verdict (benchmarks/soak_memory.py, issue 38): the trend of RSS troughs
after warm-up, exact on constructed series."""

from __future__ import annotations

import math

import pytest

from benchmarks.soak_memory import MIN_WINDOWS, WINDOWS, trough_trend

MB = 1 << 20


def sawtooth(t: float, base: float, rise_per_s: float) -> float:
    """A 100 MB sawtooth of period 40 s over a trough line base + rise_per_s * t."""
    return base + rise_per_s * t + 100 * MB * ((t % 40) / 40)


def test_a_flat_sawtooth_is_flat_whatever_its_phase_at_the_ends() -> None:
    # The old check (last sample vs the first after warm-up) read this series as +3.6%:
    # warm-up ends mid-tooth and the run near a peak; the troughs say flat.
    points = [(t, sawtooth(t, 1000 * MB, 0.0)) for t in range(0, 3600 + 39, 5)]
    trend = trough_trend(points, warmup_s=300)
    assert trend is not None and len(trend.troughs) == WINDOWS
    assert trend.growth == pytest.approx(0.0, abs=1e-3)
    assert all(v == pytest.approx(1000 * MB, rel=2e-2) for _, v in trend.troughs)


def test_rising_troughs_fail_however_the_ends_fall() -> None:
    # 40 MB a minute under the sawtooth (issue 38's prefill worker).
    rise = 40 * MB / 60
    points = [(t, sawtooth(t, 1000 * MB, rise)) for t in range(0, 900, 5)]
    trend = trough_trend(points, warmup_s=60)
    assert trend is not None
    assert trend.slope_bytes_per_s == pytest.approx(rise, rel=0.05)
    expected = rise * (points[-1][0] - 60) / (1000 * MB + rise * 60)
    assert trend.growth == pytest.approx(expected, rel=0.1)
    assert trend.growth > 0.02


def test_troughs_are_the_lowest_sample_of_each_window() -> None:
    points = [(float(t), 10.0 + (t % 3)) for t in range(80)]
    trend = trough_trend(points, warmup_s=0)
    assert trend is not None
    assert [v for _, v in trend.troughs] == [10.0] * WINDOWS
    assert trend.troughs[0] == (0.0, 10.0)  # the earliest of equal lows
    assert trend.growth == 0.0 and trend.start_bytes == trend.end_bytes == 10.0


def test_too_short_after_warm_up_has_no_verdict() -> None:
    assert trough_trend([(0.0, 1.0), (10.0, 2.0)], warmup_s=20) is None
    assert trough_trend([(30.0, 5.0), (30.0, 6.0)], warmup_s=20) is None  # no time span
    # Samples in fewer than MIN_WINDOWS windows (a gap): no verdict either.
    few = [(100.0, 1.0), (101.0, 1.0), (200.0, 2.0)]
    assert trough_trend(few, warmup_s=0) is None
    assert MIN_WINDOWS <= WINDOWS
    flat = trough_trend([(float(t), 1.0) for t in range(9)], 0)
    assert flat is not None and not math.isnan(flat.growth)
