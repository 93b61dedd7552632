"""tandem.engine.orphans: which KV-holding requests have lost their owner for good."""

from __future__ import annotations

import pytest

from tandem.engine.orphans import OrphanTracker, RecentIds


def test_an_unowned_request_is_reaped_exactly_after_the_grace() -> None:
    t = OrphanTracker(grace_s=5.0)
    owned = {"a"}
    assert t.sweep(["a", "b"], owned.__contains__, now=10.0) == []  # b first seen unowned
    assert t.sweep(["a", "b"], owned.__contains__, now=14.9) == []
    assert t.sweep(["a", "b"], owned.__contains__, now=15.0) == ["b"]
    assert len(t) == 0  # handed to the caller to abort; not reported twice
    assert t.sweep(["a"], owned.__contains__, now=30.0) == []


def test_an_owner_that_comes_back_restarts_the_clock() -> None:
    """A hand-off: dispatched (stream closed), then its lease granted a moment later."""
    t = OrphanTracker(grace_s=5.0)
    owners: set[str] = set()
    assert t.sweep(["h"], owners.__contains__, now=0.0) == []
    owners.add("h")  # the lease
    assert t.sweep(["h"], owners.__contains__, now=4.0) == []
    owners.discard("h")  # confirmed; the release is on its way to the engine
    assert t.sweep(["h"], owners.__contains__, now=6.0) == []
    assert t.sweep(["h"], owners.__contains__, now=10.9) == []
    assert t.sweep(["h"], owners.__contains__, now=11.0) == ["h"]


def test_requests_that_finished_are_forgotten() -> None:
    t = OrphanTracker(grace_s=1.0)
    assert t.sweep(["x"], lambda _: False, now=0.0) == []
    assert t.sweep([], lambda _: False, now=0.5) == []
    assert t.sweep(["x"], lambda _: False, now=1.2) == []  # a new life: a new clock
    assert t.sweep(["x"], lambda _: False, now=2.2) == ["x"]


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        OrphanTracker(0.0)


def test_recent_ids_bound_count_and_age() -> None:
    ids = RecentIds(max_ids=2, ttl_s=10.0)
    ids.add("a", 0.0)
    ids.add("b", 1.0)
    assert "a" in ids and "b" in ids
    ids.add("c", 2.0)  # over the count: the oldest goes
    assert "a" not in ids and "b" in ids and "c" in ids
    ids.add("d", 12.5)  # b (1.0) and c (2.0) are older than 10 s now
    assert "b" not in ids and "c" not in ids and "d" in ids
    ids.add("d", 13.0)  # re-adding refreshes, never duplicates
    assert "d" in ids


def test_a_discarded_id_may_be_used_again() -> None:
    ids = RecentIds()
    ids.add("alt", 0.0)
    ids.discard("alt")
    ids.discard("never-added")  # no error
    assert "alt" not in ids
