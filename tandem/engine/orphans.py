"""Which requests hold KV blocks that nobody will ever free: the worker's safety net under
cancellation. Pure: the caller passes the live ids, an ownership test and the time.

Every request an engine holds has an owner outside it: the call that submitted it (its
output stream is open) or, on a prefill worker after the hand-off, the lease that pins its
blocks for the reader. Owners come and go in two steps on different threads (a stream closes
and the abort follows; a hand-off is dispatched and its lease is granted just after), so a
request is briefly unowned in normal operation. One that stays unowned for `grace_s` has
lost its owner for good -- an abort that never arrived, a bug -- and is reaped: aborted,
its blocks freed, counted and logged. In the strict audit mode (tests) a reap is a
violation as well, so a leak the reaper hides still fails the suite.

    live, unowned   first seen at t0 -> still unowned at t0 + grace_s -> reap
    owned again     forgotten (the clock restarts if it loses its owner again)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class OrphanTracker:
    def __init__(self, grace_s: float) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be positive, got {grace_s}")
        self.grace_s = grace_s
        self._since: dict[str, float] = {}  # unowned request id -> when first seen unowned

    def sweep(self, live: Iterable[str], owned: Callable[[str], bool], now: float) -> list[str]:
        """The ids to reap now: live, and unowned since at least `grace_s` ago. They are
        dropped from the tracker (the caller aborts them)."""
        since: dict[str, float] = {}
        reap = []
        for rid in live:
            if owned(rid):
                continue
            first = self._since.get(rid, now)
            if now - first >= self.grace_s:
                reap.append(rid)
            else:
                since[rid] = first
        self._since = since  # ids no longer live or owned again are forgotten
        return reap

    def __len__(self) -> int:
        return len(self._since)


class RecentIds:
    """Request ids aborted lately, bounded in count and age: an abort that overtakes its
    request (the two calls race on the wire) still stops it when the request arrives. The
    caller discards an id once the call it was meant for has seen it, so an id may be used
    again afterwards."""

    def __init__(self, max_ids: int = 4096, ttl_s: float = 120.0) -> None:
        self.max_ids = max_ids
        self.ttl_s = ttl_s
        self._ids: dict[str, float] = {}  # insertion order = age order

    def add(self, request_id: str, now: float) -> None:
        self._ids.pop(request_id, None)
        self._ids[request_id] = now
        self._trim(now)

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _trim(self, now: float) -> None:
        while self._ids:
            oldest, t = next(iter(self._ids.items()))
            if len(self._ids) <= self.max_ids and now - t <= self.ttl_s:
                return
            del self._ids[oldest]
