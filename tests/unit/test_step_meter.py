"""The engine loop's rolling load figures, on a fake clock."""

from __future__ import annotations

import pytest

from tandem.services.common.worker.engine_loop import StepMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_fraction_tokens_and_step_time_over_the_period() -> None:
    clock = Clock()
    meter = StepMeter(period_s=5.0, clock=clock)
    assert meter.read() == (0.0, 0.0, 0.0)  # idle
    clock.now += 10
    for _ in range(10):  # 10 steps of 0.2 s computing 50 tokens each, back to back
        clock.now += 0.2
        meter.record(0.2, 50)
    busy, tps, step_ms = meter.read()
    assert busy == pytest.approx(2.0 / 5.0)
    assert tps == pytest.approx(500 / 5.0)
    assert step_ms == pytest.approx(200.0)
    clock.now += 4.9  # only the last step ended inside the window, 0.1 s of it
    busy, tps, _ = meter.read()
    assert busy == pytest.approx(0.1 / 5.0, abs=1e-9)
    assert tps == pytest.approx(50 / 5.0)
    clock.now += 1.0
    assert meter.read() == (0.0, 0.0, 0.0)


def test_a_young_meter_divides_by_its_age_not_the_full_period() -> None:
    clock = Clock()
    meter = StepMeter(period_s=5.0, clock=clock)
    clock.now += 1.0
    meter.record(1.0, 100)  # busy the whole first second
    busy, tps, _ = meter.read()
    assert busy == pytest.approx(1.0)
    assert tps == pytest.approx(100.0)
    with pytest.raises(ValueError, match="period_s"):
        StepMeter(period_s=0)


def test_prefill_rate_counts_prompt_tokens_over_the_steps_that_computed_them() -> None:
    clock = Clock()
    meter = StepMeter(period_s=5.0, clock=clock)
    assert meter.prefill_tokens_per_s() == 0.0  # never measured
    clock.now += 1
    meter.record(0.5, 1000, 990)  # a prefill chunk (and 10 decode rows): 990 prompt tokens
    clock.now += 1
    meter.record(0.03, 8, 0)  # a decode step: no prompt tokens, not in the rate
    clock.now += 1
    meter.record(0.5, 1000, 1010)
    assert meter.prefill_tokens_per_s() == pytest.approx(2000 / 1.0)
    clock.now += 60  # idle for a minute: the last measured rate is kept
    assert meter.read() == (0.0, 0.0, 0.0)
    assert meter.prefill_tokens_per_s() == pytest.approx(2000.0)


def test_the_prefill_rate_is_the_slowest_within_the_horizon() -> None:
    """Admission plans with the pessimistic rate: a slow spell counts at once and for
    rate_horizon_s, a fast one only once the slow ones have aged out."""
    clock = Clock()
    meter = StepMeter(period_s=5.0, clock=clock, rate_horizon_s=60.0)
    meter.seed_prefill_rate(200.0)  # the warm-up's
    assert meter.prefill_tokens_per_s() == pytest.approx(200.0)
    clock.now += 1
    meter.record(1.0, 500, 500)  # alone on the host: 500 tokens/s
    assert meter.prefill_tokens_per_s() == pytest.approx(200.0)  # the seed is still recent
    clock.now += 60  # the seed ages out; the 500 tokens/s step is outside the 5 s window
    assert meter.prefill_tokens_per_s() == pytest.approx(500.0)  # kept: the latest measured
    meter.record(2.0, 300, 300)  # a decode batch beside it: 150 tokens/s
    assert meter.prefill_tokens_per_s() == pytest.approx(150.0)  # slower at once
    clock.now += 10
    meter.record(1.0, 600, 600)  # fast again
    assert meter.prefill_tokens_per_s() == pytest.approx(150.0)  # not trusted yet
    clock.now += 51  # the slow spell (measured 61 s ago) ages out
    meter.record(1.0, 600, 600)
    assert meter.prefill_tokens_per_s() == pytest.approx(600.0)
