"""tandem.routing.admission: refuse at once what could not start within the limit."""

from __future__ import annotations

import pytest

from tandem.routing.admission import Admission, estimate_delay_s, queued_tokens


def test_queued_tokens_take_the_larger_of_reported_and_inflight() -> None:
    assert queued_tokens(reported=4000, inflight=1500) == 4000  # other routers' work too
    assert queued_tokens(reported=0, inflight=1500) == 1500  # a burst the heartbeat lags
    assert queued_tokens(0, 0) == 0


def test_the_estimate_is_queue_plus_prompt_over_rate() -> None:
    assert estimate_delay_s(6000, 2000, 400.0) == pytest.approx(20.0)
    assert estimate_delay_s(0, 100, 1000.0) == pytest.approx(0.1)
    assert estimate_delay_s(-5, 100, 1000.0) == pytest.approx(0.1)  # never below the prompt
    assert estimate_delay_s(6000, 2000, 0.0) is None  # no rate measured yet


@pytest.mark.parametrize(
    ("estimate", "limit", "admitted", "retry"),
    [
        (None, 30.0, True, 0.0),  # nothing to estimate from: admit
        (29.9, 30.0, True, 0.0),
        (30.0, 30.0, True, 0.0),  # at the limit: admitted
        (30.2, 30.0, False, 1.0),  # just over: retry in the minimum 1 s
        (42.5, 30.0, False, 13.0),  # the queue needs 12.5 s to drain to the limit: 13 s
        (500.0, 30.0, False, 60.0),  # capped
        (500.0, 0.0, True, 0.0),  # limit 0: the check is off
    ],
)
def test_decide(estimate: float | None, limit: float, admitted: bool, retry: float) -> None:
    a = Admission.decide(estimate, limit, "p0")
    assert a.admitted is admitted
    assert a.retry_after_s == retry
    assert a.estimate_s == estimate
    if not admitted:
        assert "p0" in a.reason and f"max_queue_delay_s {limit:g}" in a.reason
