"""Per-worker circuit breakers from the outcomes of a router's own RPCs. Pure: the caller
passes the time.

The registry (Redis) drops a dead worker only after its TTL, and not at all while Redis is
down; a router that sees a worker fail a call takes it out of its own rotation at once:

  closed     the worker gets requests. `breaker_threshold` consecutive failures -> open.
  open       no requests for `breaker_cooldown_s` (doubling on each failed probe, up to
             `breaker_max_cooldown_s`), then half-open.
  half-open  one request is let through as a probe: success -> closed, failure -> open.

A worker that re-registers with a new incarnation (a restart: new epoch) starts closed, so
the registry still brings workers back. Only worker faults count as failures (the router
decides which: unavailable, frozen past keepalive, an internal error), never a request's
own errors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    breaker_threshold: int = 1
    breaker_cooldown_s: float = 1.0
    breaker_max_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.breaker_threshold < 1:
            raise ValueError(f"breaker_threshold must be >= 1, got {self.breaker_threshold}")
        if not 0 < self.breaker_cooldown_s <= self.breaker_max_cooldown_s:
            raise ValueError(
                "need 0 < breaker_cooldown_s <= breaker_max_cooldown_s, got "
                f"{self.breaker_cooldown_s}, {self.breaker_max_cooldown_s}"
            )


@dataclass(slots=True)
class _Breaker:
    epoch: int | None  # the incarnation it judged, once known
    failures: int = 0  # consecutive
    opened_at: float | None = None
    cooldown_s: float = 0.0
    probing: bool = False  # half-open and the probe request is out


class CircuitBreakers:
    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._breakers: dict[str, _Breaker] = {}

    def _get(self, worker_id: str, epoch: int | None = None) -> _Breaker:
        b = self._breakers.get(worker_id)
        if b is None or (epoch is not None and b.epoch is not None and epoch != b.epoch):
            b = self._breakers[worker_id] = _Breaker(epoch=epoch)
        elif b.epoch is None:
            b.epoch = epoch
        return b

    def state(self, worker_id: str, now: float, epoch: int | None = None) -> BreakerState:
        """The worker's state; `epoch`, when given, resets a breaker of an older incarnation."""
        b = self._get(worker_id, epoch)
        if b.opened_at is None:
            return BreakerState.CLOSED
        if now - b.opened_at < b.cooldown_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows(self, worker_id: str, now: float, epoch: int | None = None) -> bool:
        """May a request go to the worker now? (Placement filters candidates with this.)
        A half-open worker is allowed until its probe is claimed."""
        state = self.state(worker_id, now, epoch)
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._breakers[worker_id].probing

    def claim(self, worker_id: str, now: float) -> None:
        """A request was sent to the worker: if it is half-open, that request is its probe."""
        b = self._get(worker_id)
        if self.state(worker_id, now) is BreakerState.HALF_OPEN:
            b.probing = True

    def success(self, worker_id: str) -> None:
        b = self._get(worker_id)
        b.failures, b.opened_at, b.cooldown_s, b.probing = 0, None, 0.0, False

    def failure(self, worker_id: str, now: float) -> bool:
        """Record a worker fault; True when this call opened (or re-opened) the breaker."""
        b = self._get(worker_id)
        b.failures += 1
        if b.opened_at is not None:  # a failed probe (or a late failure while open)
            was_probe = b.probing or now - b.opened_at >= b.cooldown_s
            if was_probe:
                b.cooldown_s = min(b.cooldown_s * 2, self.config.breaker_max_cooldown_s)
                b.opened_at, b.probing = now, False
            return was_probe
        if b.failures >= self.config.breaker_threshold:
            b.opened_at, b.cooldown_s, b.probing = now, self.config.breaker_cooldown_s, False
            return True
        return False

    def forget(self, worker_id: str) -> None:
        """The worker left the registry."""
        self._breakers.pop(worker_id, None)

    def open_workers(self, now: float) -> list[str]:
        return sorted(w for w in self._breakers if self.state(w, now) is BreakerState.OPEN)
