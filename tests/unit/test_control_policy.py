"""The P:D ratio policy on plain data: scenario tables driven through a toy cluster whose
load responds to the replica counts the policy chooses."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tandem.control import (
    SLA,
    ControlConfig,
    ControlState,
    Decision,
    Goodput,
    Hold,
    HostCapacity,
    Observation,
    RequestSample,
    Trial,
    WorkerSample,
    decide,
    fit_decode_step,
    fit_prefill,
    percentile,
)

PREFILL_CAPACITY = 2000.0  # tokens/s one prefill worker computes while busy
STEP_A, STEP_B = 10.0, 2.0  # decode step_ms = a + b * running
KV_BLOCKS = 4096
SLA_ = SLA(ttft_p90_ms=1000.0, itl_p90_ms=100.0)
CONFIG = ControlConfig(
    min_prefill=1, max_prefill=8, min_decode=1, max_decode=8,
    scale_up_cooldown_s=10, scale_down_cooldown_s=30, scale_down_stable_s=30, min_requests=5,
)  # fmt: skip
TICK_S = 5.0


@dataclass
class Load:
    prefill_tps: float  # prompt tokens/s arriving for prefill workers
    decode_seqs: float  # sequences decoding concurrently


def world(
    load: Load, replicas: dict[str, int], t: float
) -> tuple[list[WorkerSample], list[RequestSample]]:
    """What workers and routers would report under `load` with these replica counts."""
    n_p, n_d = replicas["prefill"], replicas["decode"]
    workers = []
    per_p = load.prefill_tps / max(n_p, 1)
    busy_p = min(1.0, per_p / PREFILL_CAPACITY)
    backlog = max(0.0, per_p - PREFILL_CAPACITY) * 10  # queue that built up over ~10 s
    for i in range(n_p):
        workers.append(
            WorkerSample(t=t, worker_id=f"p{i}", role="prefill", busy_frac=busy_p,
                         tokens_per_s=min(per_p, PREFILL_CAPACITY),
                         step_ms=50.0 if busy_p else 0.0, queued_prefill_tokens=int(backlog))
        )  # fmt: skip
    running = load.decode_seqs / n_d
    step = STEP_A + STEP_B * running if running else 0.0
    for i in range(n_d):
        # Two workers see slightly different batches so the step model has a slope to fit.
        r = max(0, round(running + (1 if i % 2 else -1) * min(2, running / 4)))
        workers.append(
            WorkerSample(t=t, worker_id=f"d{i}", role="decode", busy_frac=1.0 if r else 0.0,
                         tokens_per_s=1000 * r / (STEP_A + STEP_B * r) if r else 0.0,
                         step_ms=STEP_A + STEP_B * r if r else 0.0, num_running=r,
                         num_blocks=KV_BLOCKS, num_free_blocks=KV_BLOCKS - 8 * r)
        )  # fmt: skip
    ttft = 100.0 + 1000.0 * backlog / (PREFILL_CAPACITY * max(n_p, 1))
    requests = [RequestSample(t, ttft, step, 1000, 64, disaggregated=True) for _ in range(10)]
    return workers, requests


def run(
    loads: list[Load], replicas: dict[str, int], state: ControlState | None = None,
    config: ControlConfig = CONFIG,
) -> tuple[list[Decision], ControlState]:  # fmt: skip
    """Drive the policy one tick per load; the window is the last 3 ticks."""
    state = state or ControlState()
    history: list[tuple[list[WorkerSample], list[RequestSample]]] = []
    decisions = []
    for i, load in enumerate(loads):
        t = i * TICK_S
        history = [*history[-2:], world(load, replicas, t)]
        obs = Observation(
            now=t,
            replicas=dict(replicas),
            workers=[w for ws, _ in history for w in ws],
            requests=[r for _, rs in history for r in rs],
            sla=SLA_,
            since=t - len(history) * TICK_S,  # each tick reports the TICK_S before it
        )
        decision, state = decide(obs, config, state)
        decisions.append(decision)
        replicas = dict(decision.target)
    return decisions, state


def counts(decisions: list[Decision], role: str) -> list[int]:
    return [d.target[role] for d in decisions]


def changes(decisions: list[Decision], role: str) -> int:
    seq = [decisions[0].current[role], *counts(decisions, role)]
    return sum(1 for a, b in zip(seq, seq[1:], strict=False) if a != b)


LOW = Load(prefill_tps=500, decode_seqs=8)
PREFILL_HEAVY = Load(prefill_tps=7000, decode_seqs=8)
DECODE_HEAVY = Load(prefill_tps=500, decode_seqs=120)
BOTH_HEAVY = Load(prefill_tps=7000, decode_seqs=120)


@pytest.mark.parametrize(
    ("name", "load", "want_prefill", "want_decode"),
    [
        # prefill: 7000 / (2000 * 0.7) = 5 workers; decode: batch within 100 ms ITL is 45,
        # 120 / (45 * 0.7) -> 4 workers.
        ("prefill-bound", PREFILL_HEAVY, 5, 1),
        ("decode-bound", DECODE_HEAVY, 1, 4),
        ("mixed", BOTH_HEAVY, 5, 4),
        ("light", LOW, 1, 1),
    ],
)
def test_steady_load_converges_to_the_modelled_counts(
    name: str, load: Load, want_prefill: int, want_decode: int
) -> None:
    decisions, _ = run([load] * 30, {"prefill": 1, "decode": 1})
    final = decisions[-1].target
    assert (final["prefill"], final["decode"]) == (want_prefill, want_decode), [
        d.summary() for d in decisions
    ]
    # Converged and stayed: nothing changes over the last 10 ticks.
    assert len({(d.target["prefill"], d.target["decode"]) for d in decisions[-10:]}) == 1
    # Scale-up came in steps of at most max_step, never overshooting the final count.
    for role in ("prefill", "decode"):
        seq = [1, *counts(decisions, role)]
        assert all(b - a <= CONFIG.max_step for a, b in zip(seq, seq[1:], strict=False))
        assert max(seq) == seq[-1]


def test_every_decision_has_a_readable_reason() -> None:
    decisions, _ = run([PREFILL_HEAVY] * 4, {"prefill": 1, "decode": 1})
    first = decisions[0]
    assert first.target["prefill"] == 3  # 1 + max_step
    assert first.reasons["prefill"].startswith("scale up 1 -> 3: demand ")
    assert "tok/s per worker" in first.reasons["prefill"]
    assert first.reasons["decode"].startswith("hold 1: ")
    # Wants more, but the scale-up is on probation (its workers serve from the next tick).
    assert (
        decisions[1]
        .reasons["prefill"]
        .endswith(
            "; wants 10, but judging scale up 1 -> 3: 0/30 s of goodput since its workers serve"
        )
    )
    assert first.figures["prefill_capacity_tps"] == pytest.approx(PREFILL_CAPACITY)
    # Without probation, the cooldown is what holds it (within 10 s of the last change).
    unjudged = replace(CONFIG, scale_up_trial_s=0)
    decisions, state = run([PREFILL_HEAVY] * 2, {"prefill": 1, "decode": 1}, config=unjudged)
    assert "in scale-up cooldown (5/10 s)" in decisions[1].reasons["prefill"]
    assert state.trials == {}


def test_decode_model_fits_the_step_time_and_respects_the_itl_sla() -> None:
    decisions, state = run([DECODE_HEAVY] * 20, {"prefill": 1, "decode": 1})
    assert state.decode_step_model is not None
    a, b = state.decode_step_model
    assert (a, b) == (pytest.approx(STEP_A, abs=1e-6), pytest.approx(STEP_B, abs=1e-6))
    # Largest batch whose step fits 100 ms: (100 - 10) / 2 = 45 sequences.
    assert decisions[-1].figures["decode_batch_capacity"] == pytest.approx(45, rel=0.01)


def test_bursty_load_scales_up_at_once_and_down_only_after_a_stable_low() -> None:
    loads = [LOW] * 2 + [PREFILL_HEAVY] * 3 + [LOW] * 40
    decisions, _ = run(loads, {"prefill": 1, "decode": 1})
    seq = counts(decisions, "prefill")
    peak_at = seq.index(max(seq))
    assert max(seq) >= 3 and peak_at <= 4  # up within the burst
    # Down one worker at a time, the first not before the load was low for 30 s.
    downs = [i for i in range(1, len(seq)) if seq[i] < seq[i - 1]]
    assert all(seq[i - 1] - seq[i] == 1 for i in downs)
    first_low = 5
    assert (downs[0] - first_low) * TICK_S >= CONFIG.scale_down_stable_s
    # Successive scale-downs are at least the cooldown apart; never back up while low.
    gaps = [(b - a) * TICK_S for a, b in zip(downs, downs[1:], strict=False)]
    assert all(gap >= CONFIG.scale_down_cooldown_s for gap in gaps)
    assert seq[-1] == 1
    assert all(b <= a for a, b in zip(seq[peak_at:], seq[peak_at + 1 :], strict=False))


@pytest.mark.parametrize("period", [1, 2, 3])
def test_flapping_input_does_not_oscillate(period: int) -> None:
    """Load alternating between heavy and light every `period` ticks: the count goes up and
    stays there (the light phases never last the stable period), so no up-down-up cycles."""
    pattern = [BOTH_HEAVY] * period + [LOW] * period
    loads = (pattern * (60 // len(pattern)))[:60]
    decisions, _ = run(loads, {"prefill": 1, "decode": 1})
    for role in ("prefill", "decode"):
        seq = [1, *counts(decisions, role)]
        downs = sum(1 for a, b in zip(seq, seq[1:], strict=False) if b < a)
        assert downs == 0, (role, seq)
        assert changes(decisions, role) <= 3  # a few steps up, then steady


def test_no_data_holds_and_says_so() -> None:
    obs = Observation(now=0.0, replicas={"prefill": 2, "decode": 3}, sla=SLA_)
    decision, _ = decide(obs, CONFIG, ControlState())
    assert decision.target == {"prefill": 2, "decode": 3}
    assert not decision.changed
    assert "no busy prefill samples" in decision.reasons["prefill"]
    assert "no busy decode samples" in decision.reasons["decode"]


def test_idle_cluster_shrinks_to_the_minimum_using_remembered_fits() -> None:
    decisions, state = run([BOTH_HEAVY] * 10, {"prefill": 1, "decode": 1})
    idle = Load(prefill_tps=0, decode_seqs=0)
    after, _ = run([idle] * 60, dict(decisions[-1].target), state)
    assert after[-1].target == {"prefill": 1, "decode": 1}
    assert all("scale up" not in d.summary() for d in after)


@pytest.mark.parametrize(
    ("replicas", "want", "reason"),
    [
        ({"prefill": 0, "decode": 1}, {"prefill": 1, "decode": 1}, "0 outside bounds [1, 8]"),
        ({"prefill": 12, "decode": 1}, {"prefill": 8, "decode": 1}, "12 outside bounds [1, 8]"),
    ],
)
def test_bounds_are_enforced(replicas: dict[str, int], want: dict[str, int], reason: str) -> None:
    obs = Observation(now=0.0, replicas=replicas, sla=SLA_)
    decision, _ = decide(obs, CONFIG, ControlState())
    assert decision.target == want
    assert decision.reasons["prefill"] == reason


def test_max_bound_caps_scale_up_with_a_reason() -> None:
    small = ControlConfig(max_prefill=2, min_requests=5)
    decisions, _ = run([PREFILL_HEAVY] * 6, {"prefill": 1, "decode": 1}, config=small)
    assert counts(decisions, "prefill")[-1] == 2
    assert "max_prefill is 2" in decisions[-1].reasons["prefill"]


def test_pinned_ratio_is_held_within_bounds() -> None:
    state = ControlState(pinned=(2, 3))
    decisions, _ = run([PREFILL_HEAVY] * 5, {"prefill": 1, "decode": 1}, state)
    assert all(d.target == {"prefill": 2, "decode": 3} for d in decisions)
    assert decisions[-1].reasons["prefill"] == "pinned by operator at 2"
    wide = ControlState(pinned=(20, 3))
    decision, _ = decide(Observation(0.0, {"prefill": 1, "decode": 1}, sla=SLA_), CONFIG, wide)
    assert decision.target["prefill"] == 8
    assert decision.reasons["prefill"] == "pinned by operator at 20 (bounded to 8)"


def test_scale_down_waits_for_draining_workers() -> None:
    workers = [
        WorkerSample(t=0.0, worker_id="p0", role="prefill", busy_frac=0.0),
        WorkerSample(t=0.0, worker_id="p1", role="prefill", busy_frac=0.0, draining=True),
    ]
    state = ControlState(prefill_capacity_tps=PREFILL_CAPACITY, low_since={"prefill": -1000.0})
    obs = Observation(100.0, {"prefill": 3, "decode": 1}, workers=workers, sla=SLA_)
    decision, _ = decide(obs, CONFIG, state)
    assert decision.target["prefill"] == 3
    assert "1 worker(s) still draining" in decision.reasons["prefill"]
    # The same, drained: one worker goes.
    obs = Observation(100.0, {"prefill": 3, "decode": 1}, workers=workers[:1], sla=SLA_)
    decision, _ = decide(obs, CONFIG, state)
    assert decision.target["prefill"] == 2
    assert decision.reasons["prefill"].startswith("scale down 3 -> 2")


def test_ttft_violation_adds_a_prefill_worker_even_when_the_model_is_content() -> None:
    # The model thinks 1 busy worker suffices (it processes all arriving tokens), but users
    # see 3 s TTFT because of a backlog.
    w = WorkerSample(
        t=0.0, worker_id="p0", role="prefill", busy_frac=0.75, tokens_per_s=1500,
        queued_prefill_tokens=1,
    )  # fmt: skip
    reqs = [RequestSample(0.0, 3000.0, 20.0, 1000, 16) for _ in range(10)]
    replicas, ready = {"prefill": 2, "decode": 1}, {"prefill": 2, "decode": 1}
    obs = Observation(0.0, replicas, workers=[w], requests=reqs, sla=SLA_, ready=ready)
    decision, _ = decide(obs, CONFIG, ControlState())
    assert decision.target["prefill"] == 3
    assert "TTFT p90 3000 ms > SLA 1000 ms" in decision.reasons["prefill"]
    # Too few requests to trust a percentile: no SLA correction.
    obs = Observation(0.0, replicas, workers=[w], requests=reqs[:3], sla=SLA_, ready=ready)
    decision, _ = decide(obs, CONFIG, ControlState())
    assert "TTFT" not in decision.reasons["prefill"]


def test_measured_itl_above_the_model_shrinks_the_batch_capacity() -> None:
    workers = [
        WorkerSample(
            t=0.0, worker_id="d0", role="decode", busy_frac=1, step_ms=30.0, num_running=10
        ),
        WorkerSample(
            t=0.0, worker_id="d1", role="decode", busy_frac=1, step_ms=50.0, num_running=20
        ),
    ]
    fast = [RequestSample(0.0, 100.0, 40.0, 100, 50) for _ in range(10)]
    slow = [RequestSample(0.0, 100.0, 80.0, 100, 50) for _ in range(10)]
    base = dict(now=0.0, replicas={"prefill": 1, "decode": 2}, workers=workers, sla=SLA_)
    d_fast, _ = decide(Observation(**base, requests=fast), CONFIG, ControlState())  # type: ignore[arg-type]
    d_slow, _ = decide(Observation(**base, requests=slow), CONFIG, ControlState())  # type: ignore[arg-type]
    # Model: step = 10 + 2 * batch; at the mean batch 15 it predicts 40 ms.
    assert d_fast.figures["itl_measured_over_model"] == pytest.approx(1.0)
    assert d_slow.figures["itl_measured_over_model"] == pytest.approx(2.0)
    assert d_slow.figures["decode_batch_capacity"] == pytest.approx(
        d_fast.figures["decode_batch_capacity"] / 2
    )


def test_fits_on_plain_samples() -> None:
    samples = [
        WorkerSample(t=0.0, worker_id="d0", role="decode", step_ms=14.0, num_running=2),
        WorkerSample(t=0.0, worker_id="d1", role="decode", step_ms=26.0, num_running=8),
        WorkerSample(
            t=1.0, worker_id="d0", role="decode", step_ms=0.0, num_running=0
        ),  # idle: ignored
    ]
    assert fit_decode_step(samples) == (pytest.approx(10.0), pytest.approx(2.0))
    assert fit_decode_step(samples[:1]) == (0.0, 7.0)  # one batch size: no fixed cost assumed
    assert fit_decode_step(samples[2:]) is None
    noisy = [  # nearly equal batches whose steps imply a negative fixed cost
        WorkerSample(t=0.0, worker_id="d0", role="decode", step_ms=30.0, num_running=10),
        WorkerSample(t=0.0, worker_id="d1", role="decode", step_ms=40.0, num_running=11),
    ]
    assert fit_decode_step(noisy) == (0.0, pytest.approx(35.0 / 10.5))
    p = [
        WorkerSample(t=0.0, worker_id="p0", role="prefill", busy_frac=0.5, tokens_per_s=1000),
        WorkerSample(t=0.0, worker_id="p1", role="prefill", busy_frac=1.0, tokens_per_s=2000,
                     queued_prefill_tokens=4000),
    ]  # fmt: skip
    capacity, demand, busy = fit_prefill(p, SLA_)
    assert capacity == pytest.approx(2000.0)
    assert demand == pytest.approx(3000 + 4000 / 1.0)  # rate + backlog over the 1 s TTFT
    assert busy == pytest.approx(0.75)


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 11))
    assert percentile(values, 90) == 9
    assert percentile(values, 100) == 10
    assert percentile([5.0], 50) == 5.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 90)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_prefill": 3, "max_prefill": 2}, "min_prefill <= max_prefill"),
        ({"min_decode": 0}, "min_decode must be >= 1"),
        ({"target_utilization": 0}, "target_utilization"),
        ({"hysteresis": 1.0}, "hysteresis"),
        ({"max_step": 0}, "max_step"),
        ({"scale_down_stable_s": -1}, "scale_down_stable_s"),
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ControlConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttft_p90_ms"):
        SLA(ttft_p90_ms=0)


# -- probation, start-up and host capacity ----------------------------------------------------

TRIAL = replace(CONFIG, scale_up_trial_s=20.0, worker_start_timeout_s=60.0, undo_cooldown_s=100.0)


def contended(
    t: float, replicas: dict[str, int], num_met: int, ready: int | None = None
) -> Observation:
    """One tick of a prefill-bound cluster whose prefill workers share one core: however
    many serve, together they compute 2000 tok/s, and `num_met` of the tick's 10 requests
    meet the SLA. `ready` prefill workers serve (default: all asked for)."""
    n = replicas["prefill"] if ready is None else ready
    workers = [
        WorkerSample(t=t, worker_id=f"p{i}", role="prefill", busy_frac=1.0,
                     tokens_per_s=2000.0 / n, queued_prefill_tokens=6000 // n)
        for i in range(n)
    ] + [WorkerSample(t=t, worker_id="d0", role="decode", busy_frac=0.2, step_ms=12.0,
                      num_running=1)]  # fmt: skip
    requests = [
        RequestSample(t, 500.0 if i < num_met else 3000.0, 12.0, 1000, 16) for i in range(10)
    ]
    ready_counts = {"prefill": n, "decode": 1}
    return Observation(
        t, dict(replicas), workers, requests, SLA_, ready=ready_counts, since=t - TICK_S
    )


def test_a_scale_up_that_adds_contention_is_undone_and_held_off() -> None:
    one = {"prefill": 1, "decode": 1}
    decision, state = decide(contended(0.0, one, num_met=4), TRIAL, ControlState())
    assert decision.target == {"prefill": 3, "decode": 1}
    assert state.trials == {"prefill": Trial(0.0, 1, 3, Goodput(4, 10, 5.0), 2000.0)}
    three = {"prefill": 3, "decode": 1}
    # Its workers still loading: 1 of 3 serves; nothing more is added meanwhile.
    decision, state = decide(contended(5.0, three, num_met=4, ready=1), TRIAL, state)
    assert decision.target == three
    assert decision.reasons["prefill"].endswith(
        "but scale up 1 -> 3 not serving yet: 1/3 prefill workers serve (5/60 s)"
    )
    decision, state = decide(contended(10.0, three, num_met=3), TRIAL, state)
    assert decision.reasons["prefill"].endswith(
        "but judging scale up 1 -> 3: 0/20 s of goodput since its workers serve"
    )
    assert state.trials["prefill"].serving_since == 10.0
    decision, state = decide(contended(25.0, three, num_met=2), TRIAL, state)
    assert decision.target == three
    # 20 s after they all serve: 2 of 10 met in the last 5 s (0.4 req/s) against 4 (0.8
    # req/s) before, and the three together computed what one did.
    decision, state = decide(contended(30.0, three, num_met=2), TRIAL, state)
    assert decision.target == one
    assert decision.reasons["prefill"] == (
        "scale up 1 -> 3 undone: goodput 0.40 req/s within the SLA after, 0.80 before; its "
        "workers computed 2000 tok/s, 2000 before; back to 1, no prefill scale-up for 100 s"
    )
    assert decision.reasons["decode"].startswith("hold 1: ")
    assert {k: v for k, v in decision.figures.items() if k.startswith("prefill_")} == {
        "prefill_demand_tps": pytest.approx(2000.0 + 6000 / 1.0),
        "prefill_busy": 1.0,
        "prefill_capacity_tps": pytest.approx(2000.0 / 3),
        "prefill_goodput_before_rps": pytest.approx(0.8),
        "prefill_goodput_after_rps": pytest.approx(0.4),
        "prefill_work_before_tps": pytest.approx(2000.0),
        "prefill_work_after_tps": pytest.approx(2000.0),
    }
    assert state.trials == {}
    why = decision.reasons["prefill"].split("; back to")[0]
    assert state.holds == {"prefill": Hold(130.0, why)}
    assert state.last_change["prefill"] == 30.0
    # The load is as high as ever, but no scale-up of prefill during the cool-down.
    decision, state = decide(contended(35.0, one, num_met=4), TRIAL, state)
    assert decision.target == one
    assert decision.reasons["prefill"].endswith(f"but {why}; no prefill scale-up for 95 s more")
    decision, state = decide(contended(130.0, one, num_met=4), TRIAL, state)
    assert state.holds == {}
    assert decision.target == three and decision.reasons["prefill"].startswith("scale up 1 -> 3")


def test_a_scale_up_that_raised_goodput_is_kept_and_says_so() -> None:
    decisions, state = run([PREFILL_HEAVY] * 8, {"prefill": 1, "decode": 1})
    assert counts(decisions, "prefill") == [3, 3, 3, 3, 3, 3, 3, 5]
    # Judged at 35 s, 30 s after its workers served: 30 requests within the SLA over the
    # 15 s the window holds, none in the 5 s before the scale-up.
    assert (
        decisions[7]
        .reasons["prefill"]
        .endswith("; scale up 1 -> 3 kept: goodput 2.00 req/s within the SLA after, 0.00 before")
    )
    assert decisions[7].figures["prefill_goodput_after_rps"] == pytest.approx(2.0)
    assert state.trials["prefill"].before == 3 and state.trials["prefill"].after == 5


def test_pending_workers_are_not_capacity_and_get_no_company() -> None:
    """Kubernetes: the Deployment asks for 3 decode pods, 1 is ready (2 cannot be scheduled).
    No more are added while they are Pending, and the scale-up that asked for them is
    undone once worker_start_timeout_s has passed."""
    decisions: list[Decision] = []
    state, asked = ControlState(), {"prefill": 1, "decode": 1}
    for i in range(13):
        t = i * TICK_S
        workers, requests = world(DECODE_HEAVY, {"prefill": 1, "decode": 1}, t)  # 1 serves
        obs = Observation(t, dict(asked), workers, requests, SLA_, since=t - TICK_S)
        decision, state = decide(obs, TRIAL, state)
        decisions.append(decision)
        asked = dict(decision.target)
    assert counts(decisions, "decode") == [3] * 12 + [1]
    assert (
        decisions[1]
        .reasons["decode"]
        .endswith("but scale up 1 -> 3 not serving yet: 1/3 decode workers serve (5/60 s)")
    )
    assert decisions[12].reasons["decode"] == (
        "scale up 1 -> 3 undone: 2 added decode worker(s) not serving after 60 s (still "
        "starting, or not schedulable); back to 1, no decode scale-up for 100 s"
    )
    # Without a trial (a restarted controller): Pending pods still hold a scale-up back.
    workers, requests = world(DECODE_HEAVY, {"prefill": 1, "decode": 1}, 0.0)
    ready = {"prefill": 1, "decode": 1}
    obs = Observation(0.0, {"prefill": 1, "decode": 3}, workers, requests, SLA_, ready=ready)
    decision, _ = decide(obs, TRIAL, ControlState())
    assert decision.target["decode"] == 3
    assert decision.reasons["decode"].endswith(
        "but 2 of 3 decode workers not serving yet (starting, or not schedulable)"
    )


def test_a_trial_ends_when_the_count_changes_under_it_or_an_operator_pins() -> None:
    trial = Trial(0.0, 1, 3, Goodput(0, 10, 5.0), 2000.0, serving_since=5.0)
    state = ControlState(trials={"prefill": trial}, last_change={"prefill": 0.0})
    obs = contended(10.0, {"prefill": 2, "decode": 1}, num_met=0)
    decision, after = decide(obs, TRIAL, state)
    # No verdict on it; the load still asks for more, so a new scale-up (and trial) begins.
    assert decision.reasons["prefill"].startswith("scale up 2 -> 4: ")
    assert decision.reasons["prefill"].endswith(
        "; scale up 1 -> 3 no longer judged: the count is 2"
    )
    assert after.trials == {"prefill": Trial(10.0, 2, 4, Goodput(0, 10, 5.0), 2000.0)}
    decision, after = decide(obs, TRIAL, replace(state, pinned=(2, 1)))
    assert decision.reasons["prefill"] == (
        "pinned by operator at 2; scale up 1 -> 3 no longer judged: pinned by operator"
    )
    assert after.trials == {}


WHY = "2 cores, one worker per core; ..."


def test_host_capacity_clamps_a_scale_up_and_says_why() -> None:
    workers, requests = world(BOTH_HEAVY, {"prefill": 1, "decode": 1}, 0.0)
    base = Observation(0.0, {"prefill": 1, "decode": 1}, workers, requests, SLA_)
    unclamped, _ = decide(base, TRIAL, ControlState())
    assert unclamped.target == {"prefill": 3, "decode": 3}
    # Full: both held, and each reason keeps what the model wanted.
    full = replace(base, capacity=HostCapacity(2, 2, WHY))
    decision, state = decide(full, TRIAL, ControlState())
    assert decision.target == {"prefill": 1, "decode": 1}
    for role in ("prefill", "decode"):
        assert decision.reasons[role] == (
            f"hold 1: the host holds 2 workers and runs 2 ({WHY}); was: {unclamped.reasons[role]}"
        )
    assert state.trials == {} and "prefill" not in state.last_change
    assert (decision.figures["host_max_workers"], decision.figures["host_num_workers"]) == (2, 2)
    # Room for one: prefill first on a tie; its scale-up is on probation at the new count.
    decision, state = decide(replace(base, capacity=HostCapacity(3, 2, WHY)), TRIAL, ControlState())
    assert decision.target == {"prefill": 2, "decode": 1}
    assert decision.reasons["prefill"].startswith("scale up 1 -> 2: the host holds 3 workers")
    assert decision.reasons["decode"].startswith("hold 1: the host holds 3 workers")
    assert state.trials["prefill"].after == 2 and "decode" not in state.trials
    # Room for three: one at a time, prefill, decode, prefill.
    decision, _ = decide(replace(base, capacity=HostCapacity(5, 2, WHY)), TRIAL, ControlState())
    assert decision.target == {"prefill": 3, "decode": 2}
    assert decision.reasons["prefill"] == unclamped.reasons["prefill"]  # not clamped
    # Room enough: no clamp at all.
    decision, _ = decide(replace(base, capacity=HostCapacity(8, 2, WHY)), TRIAL, ControlState())
    assert decision.target == unclamped.target and decision.reasons == unclamped.reasons


def test_host_capacity_clamps_a_pinned_ratio_but_never_below_the_minimum() -> None:
    full = HostCapacity(1, 1, WHY)
    obs = Observation(0.0, {"prefill": 0, "decode": 1}, sla=SLA_, capacity=full)
    decision, _ = decide(obs, TRIAL, ControlState())
    assert decision.target == {"prefill": 1, "decode": 1}  # min_prefill, though the host is full
    assert decision.reasons["prefill"] == "0 outside bounds [1, 8]"
    obs = Observation(0.0, {"prefill": 1, "decode": 1}, sla=SLA_, capacity=HostCapacity(3, 2, WHY))
    decision, state = decide(obs, TRIAL, ControlState(pinned=(4, 4)))
    assert decision.target == {"prefill": 2, "decode": 1}
    assert decision.reasons["prefill"] == (
        f"scale up 1 -> 2: the host holds 3 workers and runs 2 ({WHY}); was: pinned by "
        "operator at 4"
    )
    assert state.trials == {}  # an operator's ratio is not judged
