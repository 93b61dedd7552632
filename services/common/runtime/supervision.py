"""When to restart a crashed child process, and how to say why it exited.

Pure policy for `tandem up`'s supervisor: no processes, no clock reads. The caller passes the
time of every exit and gets back a decision as plain data.

Per child name, exits are kept for a sliding window of `window_s` seconds:

    exits in window:   1     2     3     4     5     6 ...   (max_restarts = 5)
    decision:        0.5s  1s    2s    4s    8s   give up    (backoff_s = 0.5, cap 8 s)

A child that stays up for a whole window starts again from `backoff_s`.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class RestartConfig:
    """Restart policy knobs.

    Args:
        backoff_s: delay before the first restart within a window; doubles per exit.
        max_backoff_s: cap on the delay.
        max_restarts: restarts allowed per child within `window_s`; the next exit gives up.
            0 gives up on the first exit.
        window_s: how far back exits count.
    """

    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_restarts: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


class Restart(NamedTuple):
    """Start the child again after `delay_s`; `attempt` counts its restarts, from 1."""

    delay_s: float
    attempt: int


class GiveUp(NamedTuple):
    """Stop restarting; `reason` says which limit tripped."""

    reason: str


class RestartPolicy:
    """Exit history per child name, and the decision for each new exit."""

    def __init__(self, config: RestartConfig) -> None:
        self.config = config
        self._exits: dict[str, deque[float]] = {}
        self._attempts: dict[str, int] = {}

    def on_exit(self, name: str, now: float) -> Restart | GiveUp:
        """Record that `name` exited at time `now` (seconds, any monotonic origin) and decide.

        Raises ValueError when `now` is earlier than an exit already recorded for `name`.
        """
        cfg = self.config
        exits = self._exits.setdefault(name, deque())
        if exits and now < exits[-1]:
            raise ValueError(f"{name}: exit at {now} is earlier than the last one, {exits[-1]}")
        # Sliding window (now - window_s, now]: an exit exactly window_s ago no longer counts.
        while exits and exits[0] <= now - cfg.window_s:
            exits.popleft()
        exits.append(now)
        if len(exits) > cfg.max_restarts:
            return GiveUp(
                f"{len(exits)} exits within {cfg.window_s:g} s "
                f"(at most {cfg.max_restarts} restarts allowed)"
            )
        attempt = self._attempts.get(name, 0) + 1
        self._attempts[name] = attempt
        delay_s = cfg.backoff_s
        for _ in range(len(exits) - 1):  # a loop, not 2**n: no float overflow for large n
            delay_s = min(cfg.max_backoff_s, delay_s * 2)
        return Restart(delay_s, attempt)

    def forget(self, name: str) -> None:
        """Drop `name`'s history (it was removed on purpose; a new child may reuse the name)."""
        self._exits.pop(name, None)
        self._attempts.pop(name, None)


def describe_exit(returncode: int) -> str:
    """Why a process ended, from `Popen.returncode`: negative is the signal that killed it.

    >>> describe_exit(-9), describe_exit(3)
    ('killed by SIGKILL', 'exited with status 3')
    """
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"
