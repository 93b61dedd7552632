"""SampleWindow: which samples a prune keeps, exactly, at the boundary and out of order."""

from __future__ import annotations

import pytest

from tandem.control import RequestSample, SampleWindow, WorkerSample


def w(t: float, worker_id: str = "d0") -> WorkerSample:
    return WorkerSample(t=t, worker_id=worker_id, role="decode")


def times(window: SampleWindow[WorkerSample]) -> list[float]:
    return [s.t for s in window]


def test_empty_window() -> None:
    window = SampleWindow[WorkerSample](10.0)
    assert len(window) == 0 and list(window) == []
    window.prune(100.0)  # nothing to drop
    assert len(window) == 0
    window.extend([])
    assert times(window) == []


def test_a_sample_exactly_window_s_old_is_dropped() -> None:
    window = SampleWindow[WorkerSample](4.0)
    window.extend(w(t) for t in (5.0, 6.0, 7.0, 8.0, 9.0, 10.0))
    window.prune(10.0)  # keeps (6, 10]
    assert times(window) == [7.0, 8.0, 9.0, 10.0]
    window.prune(10.0)  # idempotent
    assert times(window) == [7.0, 8.0, 9.0, 10.0]
    window.prune(10.999)  # 7.0 is 3.999 s old: stays
    assert times(window) == [7.0, 8.0, 9.0, 10.0]
    window.prune(11.0)
    assert times(window) == [8.0, 9.0, 10.0]


def test_periodic_samples_fill_the_window_with_exactly_k() -> None:
    # Samples every 1 s into a 5 s window: every prune leaves 5, never 6.
    window = SampleWindow[WorkerSample](5.0)
    for t in range(1, 21):
        window.add(w(float(t)))
        window.prune(float(t))
        assert times(window) == [float(x) for x in range(max(1, t - 4), t + 1)]


def test_prune_keeps_samples_newer_than_now_and_everything_when_now_is_early() -> None:
    window = SampleWindow[WorkerSample](10.0)
    window.extend([w(1.0), w(2.0), w(30.0)])
    window.prune(5.0)  # horizon -5: nothing old
    assert times(window) == [1.0, 2.0, 30.0]
    window.prune(12.0)  # horizon 2: 1 and 2 go; 30 is in the future and stays
    assert times(window) == [30.0]
    window.prune(1000.0)
    assert times(window) == []


def test_insertion_order_is_kept_and_same_time_samples_stay_together() -> None:
    window = SampleWindow[WorkerSample](60.0)
    tick = [w(3.0, "p0"), w(3.0, "d0"), w(3.0, "d1")]
    window.extend(tick)
    window.add(w(4.0, "p0"))
    assert [(s.t, s.worker_id) for s in window] == [
        (3.0, "p0"), (3.0, "d0"), (3.0, "d1"), (4.0, "p0"),
    ]  # fmt: skip
    window.prune(63.0)  # the whole t=3 tick leaves at once
    assert [(s.t, s.worker_id) for s in window] == [(4.0, "p0")]


def test_out_of_order_samples_are_dropped_on_time_and_order_is_kept() -> None:
    # Requests timed by two routers: one late arrival is older than the samples before it.
    window = SampleWindow[RequestSample](10.0)
    for t in (5.0, 9.0, 2.0, 12.0, 8.0):
        window.add(RequestSample(t, 100.0, 10.0, 64, 8))
    window.prune(13.0)  # horizon 3: 2.0 goes although 5.0 and 9.0 came first
    assert [s.t for s in window] == [5.0, 9.0, 12.0, 8.0]
    window.prune(16.0)  # horizon 6: 5.0 goes, then 8.0 behind the newer 12.0
    assert [s.t for s in window] == [9.0, 12.0, 8.0]
    window.prune(18.0)  # horizon 8: 8.0 goes though it is last
    assert [s.t for s in window] == [9.0, 12.0]
    window.add(RequestSample(20.0, 100.0, 10.0, 64, 8))  # in order again
    window.prune(21.0)
    assert [s.t for s in window] == [12.0, 20.0]


@pytest.mark.parametrize("window_s", [0.0, -1.0])
def test_window_must_be_positive(window_s: float) -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        SampleWindow[WorkerSample](window_s)


def test_request_sample_of_spreads_the_time_after_token_1_over_the_later_tokens() -> None:
    from tandem.control import RequestSample

    s = RequestSample.of(t=5.0, ttft_ms=100.0, total_ms=400.0, prompt_tokens=9, output_tokens=4)
    assert (s.ttft_ms, s.itl_ms, s.output_tokens, s.cached_tokens) == (100.0, 100.0, 4, 0)
    assert RequestSample.of(5.0, 100.0, 100.0, 9, 1).itl_ms == 0.0
