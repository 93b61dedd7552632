"""tandem.routing.stall: a hop stalls on the absence of progress, not of tokens."""

from __future__ import annotations

import pytest

from tandem.routing.stall import HopProgress, StallWatch, advanced


@pytest.mark.parametrize(
    ("before", "now", "moved"),
    [
        (None, HopProgress(), True),  # the first report: the worker is there
        (HopProgress(3, 0, 10), HopProgress(3, 0, 10), False),  # the same figures again
        (HopProgress(3, 0, 10), HopProgress(3, 0, 11), True),  # the engine stepped (others)
        (HopProgress(3, 0, 10), HopProgress(2, 0, 10), True),  # moved up the queue
        (HopProgress(0, 512, 10), HopProgress(0, 1024, 10), True),  # a prefill chunk done
        (HopProgress(2, 0, 10), HopProgress(3, 0, 10), False),  # pushed back: not progress
        (HopProgress(0, 512, 10), HopProgress(0, 0, 10), False),  # preempted: not progress
    ],
)
def test_what_counts_as_an_advance(
    before: HopProgress | None, now: HopProgress, moved: bool
) -> None:
    assert advanced(before, now) is moved


def test_a_busy_worker_never_stalls_however_long_its_queue() -> None:
    watch = StallWatch(30.0, now=0.0)
    t = 0.0
    for step in range(1, 200):  # 200 s queued behind others; the engine keeps stepping
        t += 1.0
        watch.progress(HopProgress(queue_position=5, engine_steps=step), t)
        assert not watch.stalled(t)
    assert watch.remaining_s(t) == pytest.approx(30.0)


def test_reports_without_any_advance_stall_exactly_at_the_timeout() -> None:
    watch = StallWatch(30.0, now=100.0)
    assert watch.progress(HopProgress(1, 0, 7), 101.0)  # first report: the clock restarts
    for t in range(102, 131):  # the gRPC loop answers, the engine does not move
        assert not watch.progress(HopProgress(1, 0, 7), float(t))
    assert not watch.stalled(130.999)
    assert watch.stalled(131.0)


def test_output_restarts_the_clock_and_silence_stalls() -> None:
    watch = StallWatch(5.0, now=0.0)
    watch.output(4.0)
    assert watch.remaining_s(8.0) == pytest.approx(1.0)
    assert not watch.stalled(8.9)
    assert watch.stalled(9.0)


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        StallWatch(0.0, now=0.0)
