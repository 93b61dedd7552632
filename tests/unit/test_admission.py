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
        (26.9, 30.0, True, 0.0),
        (27.0, 30.0, True, 0.0),  # at the plan (0.9 of the limit): admitted
        (27.2, 30.0, False, 1.0),  # just over: retry in the minimum 1 s
        (29.9, 30.0, False, 3.0),  # within the limit but past the plan: refused
        (42.5, 30.0, False, 16.0),  # the queue needs 15.5 s to drain to the plan: 16 s
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


def test_the_router_counts_a_bursts_earlier_admissions_not_the_placement_snapshot() -> None:
    """Requests of a burst are placed concurrently, so each placement's view of the worker
    predates the others' dispatch. Admission must read the router's in-flight tokens at the
    moment it decides: the overload soak admitted 7 documents in 0.5 s on a stale view, and
    their first tokens came up to 154 s later against a 120 s limit."""
    from tandem.engine.request import RequestSpec
    from tandem.routing.policy import Placement, RouteKind, WorkerLoad
    from tandem.services.router.config import RouterConfig
    from tandem.services.router.placer import Placer

    config = RouterConfig(model_dir="m", decode_addresses=("d0:1",), max_queue_delay_s=10.0)
    placer = Placer(config, "m")
    p0 = WorkerLoad(worker_id="p0", role="prefill", address="p0:1", prefill_tokens_per_s=100.0)
    d0 = WorkerLoad(worker_id="d0", role="decode", address="d0:1")
    # both placed before either ran
    snapshot = Placement(decode=d0, prefill=p0, kind=RouteKind.KV_AFFINITY, reason="test")
    first = RequestSpec("r1", tuple(range(600)))
    second = RequestSpec("r2", tuple(range(600)))

    a1 = placer.admission(first, snapshot)
    assert a1.admitted and a1.estimate_s == pytest.approx(6.0)
    dispatch = placer.inflight.dispatch(snapshot, first.num_prompt_tokens)
    a2 = placer.admission(second, snapshot)
    assert not a2.admitted and a2.estimate_s == pytest.approx(12.0)  # 1200 tokens at 100/s
    dispatch.finish()
    assert placer.admission(second, snapshot).admitted  # the first is done: room again
