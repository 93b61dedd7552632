"""When a hop counts as stalled: the absence of progress, not of tokens. Pure: the caller
passes the time.

A worker that queues a request behind others, or spends seconds on a long prompt, is busy;
it says so with progress messages (its engine's step counter, the request's place in the
queue, the tokens it computed). A hop is stalled only when, for `timeout_s`, nothing moved:

    advance   a token or any output arrived;
              the request's computed tokens grew;
              its queue position dropped;
              the worker's engine stepped (it is computing, if for others)
    stall     no advance for timeout_s (messages that repeat the same figures, or none)

So a worker whose engine thread hangs while its gRPC loop still answers is found, and a
worker under load never is. A worker that stops answering at all (dead, frozen, cut off)
is found sooner by the channel's keepalive.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HopProgress:
    """What a worker reports about a request it has not produced output for yet."""

    queue_position: int = 0  # requests ahead of it; 0 = running
    computed_tokens: int = 0
    engine_steps: int = 0


def advanced(before: HopProgress | None, now: HopProgress) -> bool:
    """Did anything move between two reports of the same hop? (None: the first report.)"""
    if before is None:
        return True
    return (
        now.computed_tokens > before.computed_tokens
        or now.engine_steps > before.engine_steps
        or now.queue_position < before.queue_position
    )


class StallWatch:
    """One hop's stall clock. `output()` on every token-bearing message, `progress(p)` on
    every progress message; `stalled(now)` once nothing advanced for `timeout_s`."""

    def __init__(self, timeout_s: float, now: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.last_advance = now
        self._last: HopProgress | None = None

    def output(self, now: float) -> None:
        self.last_advance = now

    def progress(self, p: HopProgress, now: float) -> bool:
        """Record a report; True when it shows an advance (the clock restarts)."""
        moved = advanced(self._last, p)
        self._last = p
        if moved:
            self.last_advance = now
        return moved

    def remaining_s(self, now: float) -> float:
        """Seconds until the hop counts as stalled (<= 0: it does)."""
        return self.last_advance + self.timeout_s - now

    def stalled(self, now: float) -> bool:
        return self.remaining_s(now) <= 0
