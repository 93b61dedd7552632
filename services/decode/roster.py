"""Which workers a decode worker accepts KV hand-offs from: prefill workers, and draining
decode workers moving their streams (issue 46). Pure: fed the registry's changes, asked about
one worker identity; the clock is injected."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.services.common.redis.registry import WorkerInfo
from tandem.types import Role


class PrefillRoster:
    """The workers a decode worker may pull from (prefill workers; decode workers, whose
    hand-offs move a draining worker's streams), fed by a `WorkerWatcher`: those registered
    now, and those that left less than `retain_s` ago. A worker that died after
    handing off signed genuine handles: reading from it fails like any transfer failure and
    is recovered (kv_failed / recompute), not refused as forged.

    A worker is known by (worker id = agent name, address, epoch); a restart is a new epoch.
    """

    def __init__(self, retain_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retain_s = retain_s
        self._clock = clock
        self._live: dict[str, WorkerInfo] = {}
        # identity -> (its role, when it left)
        self._departed: dict[tuple[str, str, int], tuple[Role, float]] = {}

    def update(self, joined: Iterable[WorkerInfo], left_ids: Iterable[str]) -> None:
        """`WorkerWatcher.on_change`: a restarted worker is in both lists."""
        now = self._clock()
        for worker_id in left_ids:
            info = self._live.pop(worker_id, None)
            if info is not None:
                identity = (info.worker_id, info.address, info.epoch)
                self._departed[identity] = (Role(info.role), now)
        for info in joined:
            if info.role in (Role.PREFILL, Role.DECODE):
                self._live[info.worker_id] = info
        for identity, (_, left_at) in list(self._departed.items()):
            if now - left_at > self.retain_s:
                del self._departed[identity]

    def knows(self, worker_id: str, address: str, epoch: int) -> bool:
        return self.role(worker_id, address, epoch) is not None

    def role(self, worker_id: str, address: str, epoch: int) -> Role | None:
        """The role of the worker of that identity, if it may be pulled from; else None."""
        info = self._live.get(worker_id)
        if info is not None and info.address == address and info.epoch == epoch:
            return Role(info.role)
        departed = self._departed.get((worker_id, address, epoch))
        if departed is None or self._clock() - departed[1] > self.retain_s:
            return None
        return departed[0]

    def live_decode_workers(self, exclude: str = "") -> list[str]:
        """Registered decode workers that continue moved streams, not draining, but
        `exclude`: where a draining worker's stream can move with its KV."""
        decode = [w for w, i in self._live.items() if i.role == Role.DECODE and i.accepts_moved]
        return sorted(w for w in decode if not self._live[w].draining and w != exclude)
