"""tandem.routing.health: circuit breakers, state by state."""

from __future__ import annotations

import pytest

from tandem.routing.health import BreakerConfig, BreakerState, CircuitBreakers

OPEN, CLOSED, HALF = BreakerState.OPEN, BreakerState.CLOSED, BreakerState.HALF_OPEN


def test_opens_at_the_threshold_and_not_before():
    b = CircuitBreakers(BreakerConfig(breaker_threshold=2, breaker_cooldown_s=1.0))
    assert b.failure("w", 0.0) is False
    assert b.state("w", 0.0) is CLOSED and b.allows("w", 0.0)
    assert b.failure("w", 0.1) is True
    assert b.state("w", 0.1) is OPEN and not b.allows("w", 0.5)
    assert b.open_workers(0.5) == ["w"]


def test_success_resets_the_consecutive_count():
    b = CircuitBreakers(BreakerConfig(breaker_threshold=2))
    b.failure("w", 0.0)
    b.success("w")
    assert b.failure("w", 0.1) is False
    assert b.state("w", 0.1) is CLOSED


def test_half_open_lets_exactly_one_probe_through():
    b = CircuitBreakers(BreakerConfig(breaker_cooldown_s=1.0))
    b.failure("w", 0.0)
    assert b.state("w", 0.99) is OPEN
    assert b.state("w", 1.0) is HALF
    assert b.allows("w", 1.0)
    b.claim("w", 1.0)
    assert not b.allows("w", 1.1)  # the probe is out
    b.success("w")
    assert b.state("w", 1.2) is CLOSED and b.allows("w", 1.2)


def test_failed_probe_doubles_the_cooldown_up_to_the_cap():
    b = CircuitBreakers(BreakerConfig(breaker_cooldown_s=1.0, breaker_max_cooldown_s=3.0))
    b.failure("w", 0.0)
    b.claim("w", 1.0)
    assert b.failure("w", 1.0) is True  # probe failed: open for 2 s
    assert b.state("w", 2.9) is OPEN and b.state("w", 3.0) is HALF
    b.claim("w", 3.0)
    b.failure("w", 3.0)  # 4 s, capped at 3
    assert b.state("w", 5.9) is OPEN and b.state("w", 6.0) is HALF


def test_late_failure_of_a_call_sent_before_opening_does_not_extend_the_cooldown():
    b = CircuitBreakers(BreakerConfig(breaker_cooldown_s=1.0))
    b.failure("w", 0.0)
    assert b.failure("w", 0.5) is False  # another in-flight call failing: same outage
    assert b.state("w", 1.0) is HALF


def test_new_incarnation_starts_closed_but_same_epoch_keeps_state():
    b = CircuitBreakers()
    assert b.allows("w", 0.0, epoch=1)
    b.failure("w", 0.0)
    assert not b.allows("w", 0.1, epoch=1)
    assert b.allows("w", 0.1, epoch=2)  # restarted worker


def test_breaker_created_without_epoch_is_not_reset_by_the_first_epoch_seen():
    b = CircuitBreakers()
    b.failure("w", 0.0)
    assert not b.allows("w", 0.1, epoch=7)


def test_forget_and_isolation_between_workers():
    b = CircuitBreakers()
    b.failure("a", 0.0)
    assert b.allows("b", 0.0)
    b.forget("a")
    assert b.allows("a", 0.1)


def test_config_validation():
    with pytest.raises(ValueError):
        BreakerConfig(breaker_threshold=0)
    with pytest.raises(ValueError):
        BreakerConfig(breaker_cooldown_s=5, breaker_max_cooldown_s=1)
