"""tandem.routing.recovery: which step follows a worker fault, exactly."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.routing import WorkerLoad
from tandem.routing.recovery import (
    WORKER_FAULT_STATUSES,
    Action,
    Failure,
    Fault,
    RecoveryConfig,
    ejection_reason,
    last_of_role,
    plan_recovery,
    worker_fault,
)


def w(worker_id: str, role: str, **kw: int | bool) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, address=f"{worker_id}:1", **kw)  # type: ignore[arg-type]


FLEET = [
    w("p0", "prefill", queued_prefill_tokens=500),
    w("p1", "prefill", queued_prefill_tokens=100),
    w("p2", "prefill", queued_prefill_tokens=0, draining=True),
    w("d0", "decode", num_running=3),
    w("d1", "decode", num_running=1, num_free_blocks=10),
    w("d2", "decode", num_running=1, num_free_blocks=50),
]
CFG = RecoveryConfig()


def test_decode_failure_migrates_to_least_loaded_other_decode_with_most_free_blocks():
    r = plan_recovery(Failure(Fault.DECODE_FAILED, "d2", failed=frozenset({"d2"})), FLEET, CFG)
    assert r.action is Action.MIGRATE
    assert r.decode is not None and r.decode.worker_id == "d1"  # d2 failed, d0 busier
    assert r.prefill is None
    r = plan_recovery(Failure(Fault.DECODE_FAILED, "d0", failed=frozenset({"d0"})), FLEET, CFG)
    assert r.decode is not None and r.decode.worker_id == "d2"  # tie on load: more free


def test_decode_failure_never_returns_to_the_failed_worker_even_if_not_in_failed():
    only = [w("d0", "decode")]
    r = plan_recovery(Failure(Fault.DECODE_FAILED, "d0"), only, RecoveryConfig(hold_s=0))
    assert r.action is Action.FAIL
    assert r.reason == "decode_failed on d0; no other healthy decode worker"


def test_the_only_decode_workers_failure_holds_the_stream_for_hold_s_then_fails():
    cfg = RecoveryConfig(hold_s=30.0)
    f = Failure(Fault.DECODE_FAILED, "d0", failed=frozenset({"d0"}))
    for held in (0.0, 29.9):
        r = plan_recovery(dataclasses.replace(f, held_s=held), [w("d0", "decode")], cfg)
        assert r.action is Action.HOLD and r.decode is None
        assert r.reason == (
            "decode_failed on d0; no other healthy decode worker: holding the stream until one "
            f"is back (held {held:.1f}s of hold_s 30s)"
        )
    r = plan_recovery(dataclasses.replace(f, held_s=30.0), [], cfg)
    assert r.action is Action.FAIL
    assert r.reason == (
        "decode_failed on d0; no other healthy decode worker after holding the stream 30.0s"
    )
    # d0 back as a new incarnation (the router took it out of `failed`), or another worker
    r = plan_recovery(dataclasses.replace(f, failed=frozenset(), held_s=3.0), [w("d0", "decode")],
                      cfg)  # fmt: skip
    assert r.action is Action.HOLD  # the same id, not known to be restarted: still the dead one
    for back, restarted in (("d0", frozenset({"d0"})), ("d9", frozenset())):
        held = dataclasses.replace(f, failed=frozenset(), held_s=3.0, restarted=restarted)
        r = plan_recovery(held, [w(back, "decode")], cfg)
        assert r.action is Action.MIGRATE and r.decode is not None
        assert r.decode.worker_id == back
    # holding spends no recovery step; a prefill fault with no decode worker holds too
    r = plan_recovery(Failure(Fault.PREFILL_FAILED, "d1", "p0", failed=frozenset({"p0", "d1"})),
                      [w("p1", "prefill")], cfg)  # fmt: skip
    assert r.action is Action.HOLD
    with pytest.raises(ValueError, match="hold_s"):
        RecoveryConfig(hold_s=-1)


def test_budget_is_spent_exactly_at_max_recoveries():
    cfg = RecoveryConfig(max_recoveries=2)
    f = Failure(Fault.DECODE_FAILED, "d0", recoveries=1, failed=frozenset({"d0"}))
    assert plan_recovery(f, FLEET, cfg).action is Action.MIGRATE
    f = Failure(Fault.DECODE_FAILED, "d0", recoveries=2, failed=frozenset({"d0"}))
    r = plan_recovery(f, FLEET, cfg)
    assert r.action is Action.FAIL and "gave up after 2" in r.reason
    assert (
        plan_recovery(Failure(Fault.PREFILL_FAILED, "d0"), FLEET, RecoveryConfig(0)).action
        is Action.FAIL
    )


def test_prefill_failure_reprefills_on_least_queued_healthy_prefill_same_decode():
    f = Failure(
        Fault.PREFILL_FAILED,
        "d1",
        "p0",
        failed=frozenset({"p0"}),
        num_uncached_tokens=500,
        min_reprefill_tokens=64,
    )
    r = plan_recovery(f, FLEET, CFG)
    assert r.action is Action.REPREFILL
    assert r.prefill is not None and r.prefill.worker_id == "p1"  # p2 drains, p0 failed
    assert r.decode is not None and r.decode.worker_id == "d1"
    assert "prefill p1" in r.describe() and "decode d1" in r.describe()


def test_kv_pull_failure_reprefills_elsewhere_when_the_owner_is_excluded():
    f = Failure(Fault.KV_PULL_FAILED, "d0", "p1", failed=frozenset({"p1"}), num_uncached_tokens=100)
    r = plan_recovery(f, FLEET, CFG)
    assert r.action is Action.REPREFILL and r.prefill is not None
    assert r.prefill.worker_id == "p0"


def test_prefill_failure_recomputes_without_another_prefill_worker():
    f = Failure(
        Fault.PREFILL_FAILED, "d0", "p0", failed=frozenset({"p0", "p1"}), num_uncached_tokens=500
    )
    r = plan_recovery(f, FLEET, CFG)
    assert r.action is Action.RECOMPUTE
    assert r.decode is not None and r.decode.worker_id == "d0"
    assert "no other healthy prefill worker" in r.reason


def test_short_prompt_recomputes_rather_than_another_handoff():
    f = Failure(
        Fault.KV_PULL_FAILED,
        "d0",
        "p0",
        failed=frozenset({"p0"}),
        num_uncached_tokens=63,
        min_reprefill_tokens=64,
    )
    assert plan_recovery(f, FLEET, CFG).action is Action.RECOMPUTE
    f = Failure(
        Fault.KV_PULL_FAILED,
        "d0",
        "p0",
        failed=frozenset({"p0"}),
        num_uncached_tokens=64,
        min_reprefill_tokens=64,
    )
    assert plan_recovery(f, FLEET, CFG).action is Action.REPREFILL


def test_reprefill_off_recomputes():
    f = Failure(Fault.PREFILL_FAILED, "d0", "p0", failed=frozenset({"p0"}), num_uncached_tokens=500)
    r = plan_recovery(f, FLEET, RecoveryConfig(reprefill=False))
    assert r.action is Action.RECOMPUTE


def test_prefill_failure_with_an_unhealthy_decode_worker_moves_the_request():
    f = Failure(
        Fault.PREFILL_FAILED, "d1", "p0", failed=frozenset({"p0", "d1"}), num_uncached_tokens=500
    )
    r = plan_recovery(f, FLEET, CFG)
    assert r.action is Action.MIGRATE
    assert r.decode is not None and r.decode.worker_id == "d2"
    f = Failure(Fault.PREFILL_FAILED, "d1", "p0", failed=frozenset({"p0"}))
    assert plan_recovery(f, [w("p1", "prefill")], RecoveryConfig(hold_s=0)).action is Action.FAIL
    assert plan_recovery(f, [w("p1", "prefill")], CFG).action is Action.HOLD


def test_config_rejects_negative_budget():
    with pytest.raises(ValueError, match="max_recoveries"):
        RecoveryConfig(max_recoveries=-1)


def _alive_prefill_failed(decode_queue: int, tokens: int) -> Failure:
    del decode_queue
    return Failure(Fault.PREFILL_FAILED, "d0", "p0", failed=frozenset({"p0", "p1"}),
                   num_uncached_tokens=tokens, min_reprefill_tokens=64,
                   prefill_gone=False)  # fmt: skip


@pytest.mark.parametrize(
    ("decode_queued", "tokens", "action"),
    [
        (0, 8192, Action.RECOMPUTE),  # exactly at the limit: room
        (1, 8192, Action.FAIL),  # one token over
        (6000, 2000, Action.RECOMPUTE),
        (6000, 2193, Action.FAIL),
    ],
)
def test_a_live_prefill_workers_prompt_moves_to_decode_only_when_decode_has_room(
    decode_queued: int, tokens: int, action: Action
) -> None:
    fleet = [w("p0", "prefill"), w("p1", "prefill"),
             w("d0", "decode", queued_prefill_tokens=decode_queued)]  # fmt: skip
    r = plan_recovery(_alive_prefill_failed(decode_queued, tokens), fleet, CFG)
    assert r.action is action
    if action is Action.FAIL:
        assert "no room" in r.reason and "recompute_max_queued_tokens 8192" in r.reason
        assert r.decode is None
    else:
        assert r.decode is not None and r.decode.worker_id == "d0"
        assert "decode has room" in r.reason


def test_a_gone_prefill_workers_prompt_recomputes_on_a_busy_decode_worker() -> None:
    """The unreachable worker's queue is lost anyway: recomputing is the only way on."""
    fleet = [w("p0", "prefill"), w("d0", "decode", queued_prefill_tokens=50_000)]
    f = Failure(Fault.PREFILL_FAILED, "d0", "p0", failed=frozenset({"p0"}),
                num_uncached_tokens=4000, min_reprefill_tokens=64)  # fmt: skip
    r = plan_recovery(f, fleet, CFG)
    assert r.action is Action.RECOMPUTE and "no other healthy prefill worker" in r.reason


def test_the_decode_workers_inflight_prompts_count_towards_its_queue() -> None:
    fleet = [w("p0", "prefill"), w("d0", "decode", queued_prefill_tokens=100,
                                   inflight_prefill_tokens=8000)]  # fmt: skip
    r = plan_recovery(_alive_prefill_failed(0, 100), fleet, CFG)
    assert r.action is Action.FAIL  # 100 + 8000 + 100 > 8192


def test_config_rejects_a_negative_recompute_limit() -> None:
    with pytest.raises(ValueError, match="recompute_max_queued_tokens"):
        RecoveryConfig(recompute_max_queued_tokens=-1)


def test_worker_fault_statuses_are_exactly_the_workers_failures():
    assert WORKER_FAULT_STATUSES == {"UNAVAILABLE", "CANCELLED", "INTERNAL", "UNKNOWN", "DATA_LOSS"}
    for status in WORKER_FAULT_STATUSES:
        assert worker_fault(status)
    # The request's own outcomes: a bad request, a deadline, pushback, a refused hand-off.
    for status in (
        "OK", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    ):  # fmt: skip
        assert not worker_fault(status), status


def test_ejection_reason_prefers_unreachable_then_stalled():
    assert ejection_reason(unreachable=True, stalled=True) == "unreachable"
    assert ejection_reason(unreachable=True, stalled=False) == "unreachable"
    assert ejection_reason(unreachable=False, stalled=True) == "stalled"
    assert ejection_reason(unreachable=False, stalled=False) == "error"


def test_last_of_role_counts_live_workers_of_the_same_role_only():
    fleet = [w("p0", "prefill"), w("p1", "prefill", draining=True), w("d0", "decode")]
    assert last_of_role("p0", fleet)  # p1 drains: not live
    assert last_of_role("d0", fleet)  # the prefill workers are another role
    assert not last_of_role("p0", [*fleet, w("p2", "prefill")])
    assert not last_of_role("gone", fleet)  # not a known worker: nothing to protect
    assert not last_of_role("p1", fleet)  # draining itself, with p0 live beside it


def test_a_moved_stream_migrates_and_a_failed_pull_of_its_kv_is_recomputed() -> None:
    moved = Failure(Fault.DECODE_MOVED, "d2", failed=frozenset({"d2"}))
    takes = [w("d0", "decode", num_running=1, accepts_moved=True), *FLEET[4:]]  # d1, d2 cannot
    r = plan_recovery(moved, takes, CFG)
    assert r.action is Action.MIGRATE and r.keep_kv  # to the worker that can pull it
    assert r.decode is not None and r.decode.worker_id == "d0"
    # no decode worker continues moved streams (they predate it): the least loaded prefills
    r = plan_recovery(moved, FLEET, CFG)
    assert r.action is Action.MIGRATE and not r.keep_kv
    assert r.decode is not None and r.decode.worker_id == "d1"
    assert r.reason.endswith("(none continues moved streams: it prefills)")
    # a decode fault never keeps a hand-off
    r = plan_recovery(Failure(Fault.DECODE_FAILED, "d2", failed=frozenset({"d2"})), takes, CFG)
    assert r.action is Action.MIGRATE and not r.keep_kv
    # the new decode worker could not pull the moved KV (its owner's lease lapsed): another
    # prefill worker would hand over the prompt's KV only, so the decode worker prefills all
    pull = Failure(Fault.KV_PULL_FAILED, "d1", None, failed=frozenset({"d2"}),
                   num_uncached_tokens=500)  # fmt: skip
    r = plan_recovery(pull, FLEET, CFG)
    assert r.action is Action.RECOMPUTE and r.decode is not None and r.decode.worker_id == "d1"
    assert r.reason == "kv_pull_failed; a moved stream's hand-off: prefill on decode"
