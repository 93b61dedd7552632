"""Which prefill workers a decode worker accepts KV hand-offs from. Pure: fed the registry's
changes, asked about one worker identity; the clock is injected."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.services.common.redis.registry import WorkerInfo
from tandem.types import Role


class PrefillRoster:
    """The prefill workers a decode worker may pull from, fed by a `WorkerWatcher`: those
    registered now, and those that left less than `retain_s` ago. A worker that died after
    handing off signed genuine handles: reading from it fails like any transfer failure and
    is recovered (kv_failed / recompute), not refused as forged.

    A worker is known by (worker id = agent name, address, epoch); a restart is a new epoch.
    """

    def __init__(self, retain_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retain_s = retain_s
        self._clock = clock
        self._live: dict[str, WorkerInfo] = {}
        self._departed: dict[tuple[str, str, int], float] = {}  # identity -> when it left

    def update(self, joined: Iterable[WorkerInfo], left_ids: Iterable[str]) -> None:
        """`WorkerWatcher.on_change`: a restarted worker is in both lists."""
        now = self._clock()
        for worker_id in left_ids:
            info = self._live.pop(worker_id, None)
            if info is not None:
                self._departed[(info.worker_id, info.address, info.epoch)] = now
        for info in joined:
            if info.role == Role.PREFILL:
                self._live[info.worker_id] = info
        for identity, left_at in list(self._departed.items()):
            if now - left_at > self.retain_s:
                del self._departed[identity]

    def knows(self, worker_id: str, address: str, epoch: int) -> bool:
        info = self._live.get(worker_id)
        if info is not None and info.address == address and info.epoch == epoch:
            return True
        left_at = self._departed.get((worker_id, address, epoch))
        return left_at is not None and self._clock() - left_at <= self.retain_s
