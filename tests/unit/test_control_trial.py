"""A scale-up on probation (tandem.control.trial): goodput over covered spans, the keep/undo
rule case by case, and a trial's life from start-up to its verdict, with exact figures."""

from __future__ import annotations

import pytest

from tandem.control import SLA, ControlConfig, RequestSample, WorkerSample
from tandem.control.trial import (
    Goodput,
    Trial,
    Verdict,
    describe,
    goodput,
    improved,
    judge,
    work_rate,
)

SLA_ = SLA(ttft_p90_ms=1000.0, itl_p90_ms=100.0)
CONFIG = ControlConfig(scale_up_trial_s=20.0, worker_start_timeout_s=60.0, undo_cooldown_s=300.0)


def met(t: float) -> RequestSample:
    return RequestSample(t, 500.0, 50.0, 100, 10)


def late(t: float) -> RequestSample:
    return RequestSample(t, 5000.0, 50.0, 100, 10)


def test_goodput_counts_the_covered_part_of_the_span() -> None:
    reqs = [met(1.0), late(2.0), met(5.0), met(10.0), RequestSample(10.0, 500.0, 500.0, 9, 1)]
    # (0, 10]: 4 met (the 1-token request's ITL does not count), 1 late.
    assert goodput(reqs, SLA_, 10.0, 10.0, None) == Goodput(4, 5, 10.0)
    # The observation reaches back only to 4.0: (4, 10], a 6 s span.
    g = goodput(reqs, SLA_, 10.0, 10.0, 4.0)
    assert g == Goodput(3, 3, 6.0)
    assert (g.met_per_s, g.done_per_s, g.attainment) == (0.5, 0.5, 1.0)
    assert goodput(reqs, SLA_, 10.0, 10.0, 10.0) is None  # nothing covered
    assert Goodput(0, 0, 5.0).attainment is None


def test_work_rate_sums_a_roles_live_workers_per_tick() -> None:
    workers = [
        WorkerSample(t=5.0, worker_id="p0", role="prefill", tokens_per_s=1000.0),
        WorkerSample(t=5.0, worker_id="p1", role="prefill", tokens_per_s=500.0),
        WorkerSample(t=10.0, worker_id="p0", role="prefill", tokens_per_s=2000.0),
        WorkerSample(t=10.0, worker_id="p2", role="prefill", tokens_per_s=900.0, draining=True),
        WorkerSample(t=10.0, worker_id="d0", role="decode", tokens_per_s=7.0),
    ]
    assert work_rate(workers, "prefill", 10.0, 10.0, None) == (1500.0 + 2000.0) / 2
    assert work_rate(workers, "prefill", 10.0, 10.0, 5.0) == 2000.0
    assert work_rate(workers, "decode", 10.0, 10.0, None) == 7.0
    assert work_rate(workers, "decode", 20.0, 5.0, None) is None


@pytest.mark.parametrize(
    ("before", "after", "tps", "keep", "why"),
    [
        # 1. goodput rose.
        (Goodput(10, 20, 10.0), Goodput(15, 20, 10.0), None, True,
         "goodput 1.50 req/s within the SLA after, 1.00 before"),
        # Flat goodput, some requests late: undone.
        (Goodput(10, 20, 10.0), Goodput(10, 20, 10.0), None, False,
         "goodput 1.00 req/s within the SLA after, 1.00 before"),
        # Contention: every request slower, fewer within the SLA.
        (Goodput(10, 20, 10.0), Goodput(4, 20, 10.0), (1000.0, 1050.0), False,
         "goodput 0.40 req/s within the SLA after, 1.00 before; "
         "its workers computed 1050 tok/s, 1000 before"),
        # 2. headroom: everything within the SLA before and after.
        (Goodput(10, 10, 10.0), Goodput(9, 9, 10.0), None, True,
         "goodput 0.90 req/s within the SLA after, 1.00 before; "
         "every request within the SLA before and after"),
        # ... but no traffic after: undone.
        (Goodput(10, 10, 10.0), Goodput(0, 0, 10.0), None, False,
         "goodput 0.00 req/s within the SLA after, 1.00 before"),
        # 3. a load that outran the scale-up: goodput fell, but its workers carry more.
        (Goodput(80, 80, 10.0), Goodput(0, 150, 10.0), (7000.0, 61000.0), True,
         "goodput 0.00 req/s within the SLA after, 8.00 before, "
         "but its workers computed 61000 tok/s, 7000 before"),
        # ... by 10% exactly is not more.
        (Goodput(5, 10, 10.0), Goodput(5, 10, 10.0), (1000.0, 1100.0), False,
         "goodput 0.50 req/s within the SLA after, 0.50 before; "
         "its workers computed 1100 tok/s, 1000 before"),
        # No baseline: kept when anything met the SLA after.
        (None, Goodput(1, 3, 10.0), None, True,
         "goodput 0.10 req/s within the SLA after, none measured before"),
        (None, Goodput(0, 3, 10.0), None, False,
         "goodput 0.00 req/s within the SLA after, none measured before"),
        (Goodput(1, 1, 1.0), None, None, False, "no goodput measured after it"),
    ],
)  # fmt: skip
def test_improved(
    before: Goodput | None,
    after: Goodput | None,
    tps: tuple[float, float] | None,
    keep: bool,
    why: str,
) -> None:
    tps_before, tps_after = tps or (None, None)
    assert improved(before, after, tps_before, tps_after) == (keep, why)


def test_a_trial_waits_for_its_workers_then_judges_goodput() -> None:
    baseline = Goodput(10, 20, 20.0)  # 0.5 req/s within the SLA
    trial = Trial(100.0, 1, 3, baseline, 1000.0)
    # Starting: 2 of 3 serve.
    assert judge("prefill", trial, 110.0, 2, [], [], SLA_, CONFIG) == trial
    assert describe("prefill", trial, 110.0, 2, CONFIG) == (
        "scale up 1 -> 3 not serving yet: 2/3 prefill workers serve (10/60 s)"
    )
    # All serve at 120: judging from then.
    serving = judge("prefill", trial, 120.0, 3, [], [], SLA_, CONFIG)
    assert serving == Trial(100.0, 1, 3, baseline, 1000.0, serving_since=120.0)
    assert isinstance(serving, Trial)
    assert describe("prefill", serving, 135.0, 3, CONFIG) == (
        "judging scale up 1 -> 3: 15/20 s of goodput since its workers serve"
    )
    assert judge("prefill", serving, 135.0, 3, [], [], SLA_, CONFIG) == serving
    # Judged at 140 on (120, 140]: 30 within the SLA in 20 s = 1.5 req/s > 0.5.
    reqs = [met(120.0 + i * 0.5) for i in range(1, 31)] + [met(119.0)]
    verdict = judge("prefill", serving, 140.0, 3, reqs, [], SLA_, CONFIG)
    assert verdict == Verdict(
        True,
        "scale up 1 -> 3 kept: goodput 1.50 req/s within the SLA after, 0.50 before",
        Goodput(30, 30, 20.0),
        None,
    )


def test_a_scale_up_that_did_not_raise_goodput_is_undone() -> None:
    serving = Trial(100.0, 2, 4, Goodput(10, 20, 20.0), 3000.0, serving_since=110.0)
    reqs = [late(131.0 + i * 0.1) for i in range(10)] + [met(131.0 + i * 0.1) for i in range(8)]
    workers = [
        WorkerSample(t=130.0, worker_id=f"p{i}", role="prefill", tokens_per_s=800.0)
        for i in range(4)
    ]
    verdict = judge("prefill", serving, 140.0, 4, reqs, workers, SLA_, CONFIG)
    assert verdict == Verdict(
        False,
        "scale up 2 -> 4 undone: goodput 0.40 req/s within the SLA after, 0.50 before; "
        "its workers computed 3200 tok/s, 3000 before",
        Goodput(8, 18, 20.0),
        3200.0,
    )


def test_workers_not_serving_by_the_timeout_count_as_not_added() -> None:
    """Pending pods (or workers stuck loading): the scale-up is undone at the timeout."""
    trial = Trial(100.0, 1, 4, Goodput(1, 1, 20.0), None)
    assert judge("decode", trial, 159.0, 2, [], [], SLA_, CONFIG) == trial
    assert judge("decode", trial, 160.0, 2, [], [], SLA_, CONFIG) == Verdict(
        False,
        "scale up 1 -> 4 undone: 2 added decode worker(s) not serving after 60 s "
        "(still starting, or not schedulable)",
    )
    # A worker that was there before died meanwhile: at most the added ones are missing.
    assert judge("decode", trial, 160.0, 0, [], [], SLA_, CONFIG) == Verdict(
        False,
        "scale up 1 -> 4 undone: 3 added decode worker(s) not serving after 60 s "
        "(still starting, or not schedulable)",
    )


def test_config_validates_the_trial_knobs() -> None:
    with pytest.raises(ValueError, match="worker_start_timeout_s"):
        ControlConfig(worker_start_timeout_s=0)
    with pytest.raises(ValueError, match="scale_up_trial_s"):
        ControlConfig(scale_up_trial_s=-1)
    with pytest.raises(ValueError, match="undo_cooldown_s"):
        ControlConfig(undo_cooldown_s=-1)
