"""services/decode/roster.py: which workers a decode worker accepts hand-offs from (prefill
workers, and draining decode workers moving their streams), and where a stream can move."""

from __future__ import annotations

from tandem.services.common.redis.registry import WorkerInfo
from tandem.services.decode.roster import PrefillRoster
from tandem.types import Role


def info(worker_id: str, epoch: int, role: str = "prefill", address: str = "") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, address=address or f"h:{worker_id}", model="m", epoch=epoch
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_roster_knows_registered_and_recently_departed_prefill_workers() -> None:
    clock = Clock()
    roster = PrefillRoster(retain_s=60.0, clock=clock)
    roster.update([info("p0", 1), info("d0", 1, role="decode")], [])
    assert roster.knows("p0", "h:p0", 1)
    assert not roster.knows("p0", "h:p1", 1)  # another address
    assert not roster.knows("p0", "h:p0", 2)  # another incarnation
    # a decode worker owns the hand-offs of the streams it moves when draining
    assert roster.role("d0", "h:d0", 1) == Role.DECODE
    assert roster.role("p0", "h:p0", 1) == Role.PREFILL
    assert roster.role("d0", "h:d0", 2) is None
    assert not roster.knows("p9", "h:p9", 1)  # never registered
    clock.now = 10.0
    roster.update([info("p0", 2)], ["p0"])  # restarted: left and joined
    assert roster.knows("p0", "h:p0", 2)
    assert roster.knows("p0", "h:p0", 1)  # its handles from before the restart are genuine
    clock.now = 70.0
    assert roster.knows("p0", "h:p0", 1)  # exactly retain_s after it left: still known
    clock.now = 70.5
    assert not roster.knows("p0", "h:p0", 1)  # long gone: its leases lapsed long ago
    roster.update([], [])
    assert roster.knows("p0", "h:p0", 2)


def test_a_departed_worker_is_known_for_retain_s_then_forgotten_by_update() -> None:
    clock = Clock()
    roster = PrefillRoster(retain_s=5.0, clock=clock)
    roster.update([info("p0", 1)], [])
    clock.now = 1.0
    roster.update([], ["p0"])  # died, no restart
    assert roster.knows("p0", "h:p0", 1)
    assert not roster.knows("p0", "h:p0", 2)  # a departed identity is exact too
    clock.now = 6.0
    roster.update([], [])
    assert roster.knows("p0", "h:p0", 1)  # 5 s after: kept by the prune as well
    clock.now = 6.1
    roster.update([], [])  # pruned here
    clock.now = 6.1 - 5.0  # even a clock read before retain_s passed no longer finds it
    assert not roster.knows("p0", "h:p0", 1)


def test_a_worker_moving_address_or_leaving_unknown_is_handled() -> None:
    clock = Clock()
    roster = PrefillRoster(retain_s=30.0, clock=clock)
    roster.update([], ["ghost"])  # leaving before it was seen: nothing to remember
    assert not roster.knows("ghost", "h:ghost", 1)
    roster.update([info("p0", 1, address="h:a")], [])
    roster.update([info("p0", 2, address="h:b")], ["p0"])  # restarted on another address
    assert roster.knows("p0", "h:b", 2)
    assert roster.knows("p0", "h:a", 1)
    assert not roster.knows("p0", "h:a", 2)  # the new incarnation does not own the old port
    assert not roster.knows("p0", "h:b", 1)
    roster.update([info("d1", 1, role="decode")], [])
    roster.update([], ["d1"])  # a drained decode worker's moved streams are still pulled
    assert roster.role("d1", "h:d1", 1) == Role.DECODE


def test_streams_move_only_to_live_decode_workers_that_take_them_and_are_not_draining() -> None:
    roster = PrefillRoster(retain_s=30.0, clock=Clock())

    def decode(worker_id: str, **kw: bool) -> WorkerInfo:
        return WorkerInfo(worker_id=worker_id, role="decode", address=f"h:{worker_id}",
                          model="m", epoch=1, **kw)  # fmt: skip

    roster.update([info("p0", 1), decode("d0", accepts_moved=True),
                   decode("d1", accepts_moved=True), decode("d2", accepts_moved=True,
                   draining=True), decode("old")], [])  # fmt: skip
    assert roster.live_decode_workers() == ["d0", "d1"]  # "old" predates moved streams
    assert roster.live_decode_workers(exclude="d0") == ["d1"]
    roster.update([], ["d1"])
    assert roster.live_decode_workers(exclude="d0") == []
