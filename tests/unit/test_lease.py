"""LeaseTable: the prefill side's rule that a decode worker never uses blocks that may have
been freed while it read them. Exact, with a hand-driven clock."""

from __future__ import annotations

import itertools

import pytest

from tandem.transfer import Confirmation, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> LeaseTable:
    ids = (f"L{i}" for i in itertools.count())
    return LeaseTable(ttl_s=10.0, epoch=7, clock=clock, new_id=lambda: next(ids))


def test_grant_then_confirm_in_time_is_valid_and_releases_once(table: LeaseTable) -> None:
    lease = table.grant("r1")
    assert (lease.lease_id, lease.request_id, lease.epoch) == ("L0", "r1", 7)
    assert lease.expires_at == 110.0
    assert len(table) == 1
    assert table.confirm("L0", "r1", 7) == Confirmation(valid=True, release="r1")
    assert len(table) == 0
    # A second confirm (a retried RPC) must not free the blocks twice.
    assert table.confirm("L0", "r1", 7) == Confirmation(valid=False, release=None)


def test_lease_that_lapses_between_export_and_confirm_is_refused(
    table: LeaseTable, clock: Clock
) -> None:
    """The reader finished after the expiry instant, before the engine's expiry hook ran:
    the lease is still in the table, but the blocks may already count as free. The owner
    frees them now (exactly once) and the reader must discard its copy."""
    table.grant("r1")
    clock.now = 110.0  # exactly at expiry: no longer pinned
    assert table.confirm("L0", "r1", 7) == Confirmation(valid=False, release="r1")
    assert table.expire() == []  # already released by the confirm


def test_confirm_just_before_expiry_is_valid(table: LeaseTable, clock: Clock) -> None:
    table.grant("r1")
    clock.now = 109.999
    assert table.confirm("L0", "r1", 7).valid


def test_expire_frees_exactly_the_lapsed_leases_and_a_late_confirm_touches_nothing(
    table: LeaseTable, clock: Clock
) -> None:
    table.grant("r1")
    clock.now = 105.0
    table.grant("r2")  # expires at 115
    assert table.expire() == []
    clock.now = 110.0
    assert [x.request_id for x in table.expire()] == ["r1"]
    assert table.confirm("L0", "r1", 7) == Confirmation(valid=False, release=None)
    assert table.confirm("L1", "r2", 7) == Confirmation(valid=True, release="r2")


@pytest.mark.parametrize(
    ("lease_id", "request_id", "epoch"),
    [("L9", "r1", 7), ("L0", "r2", 7), ("L0", "r1", 6)],
    ids=["unknown lease", "another request's lease", "another incarnation"],
)
def test_foreign_confirms_are_refused_and_keep_the_lease(
    table: LeaseTable, lease_id: str, request_id: str, epoch: int
) -> None:
    table.grant("r1")
    assert table.confirm(lease_id, request_id, epoch) == Confirmation(valid=False, release=None)
    assert len(table) == 1  # the real reader can still confirm
    assert table.confirm("L0", "r1", 7).valid


def test_revoke_drops_every_lease_of_the_request(table: LeaseTable) -> None:
    table.grant("r1")
    table.grant("r2")
    table.grant("r1")
    assert [x.lease_id for x in table.revoke("r1")] == ["L0", "L2"]
    assert table.confirm("L0", "r1", 7) == Confirmation(valid=False, release=None)
    assert len(table) == 1


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s must be positive, got 0"):
        LeaseTable(ttl_s=0, epoch=1)


def test_holds_names_the_request_under_any_lease() -> None:
    from tandem.transfer import LeaseTable

    table = LeaseTable(10.0, epoch=1, clock=lambda: 0.0)
    lease = table.grant("r1")
    assert table.holds("r1") and not table.holds("r2")
    table.confirm(lease.lease_id, "r1", 1)
    assert not table.holds("r1")
