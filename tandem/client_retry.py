"""When the Python client tries a failed call again, decided once for both clients.

`Retry` is the policy, a pure function of the failed attempt's number, its error and the time
left: `Retry.next_delay_s` says how long to wait before the next attempt, or None (raise).
`Attempts` is one call's bookkeeping around it: which attempt this is and the deadline over
all of them, read from an injected clock. `TandemClient` and `AsyncTandemClient`
(tandem.client) run the same loop over these; only their calls and their sleep differ.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc


class TandemError(RuntimeError):
    """A failed call: its gRPC status `code`, the server's `message`, and `retry_after_s`,
    how long the server asked the client to wait before trying again (None: no hint)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Retry:
    """When and how long to wait before trying a failed call again.

    Attempt 1 is the first call; before attempt n >= 2 the client waits
    `delay_s(n, hint, rng())`, `hint` being the failed attempt's `retry_after_s`. A stream is
    retried only until its first chunk has been yielded to the caller, never after, so no
    token reaches the caller twice. With a client `timeout_s`, the timeout covers all
    attempts and the waits between them: a retry that could not start before it runs out is
    not made. Abort is never retried.

    Args:
        max_attempts: attempts in all, the first included (1: never retry).
        initial_backoff_s: the wait before attempt 2, before jitter.
        max_backoff_s: no wait is longer, not even one a server asks for.
        multiplier: each further wait is this much longer than the one before.
        codes: the statuses worth a retry.
        jitter: each wait is the backoff times a factor drawn from
            [1 - jitter, 1 + jitter), so clients that failed together do not retry together.
        rng: the jitter's random source, uniform in [0, 1) (a test passes a fixed one).
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    codes: tuple[grpc.StatusCode, ...] = (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    jitter: float = 0.2
    rng: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s} "
                f"and {self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, attempt: int, retry_after_s: float | None = None, u: float = 0.5) -> float:
        """Seconds to wait before attempt `attempt` (>= 2) after the previous one failed.

        The backoff is initial_backoff_s * multiplier ** (attempt - 2), at most max_backoff_s,
        times the jitter factor 1 + jitter * (2u - 1) (u = 0.5: none). A server's hint
        `retry_after_s` wins when it is longer. The result is at most max_backoff_s.

        Raises ValueError for attempt < 2 or u outside [0, 1]."""
        if attempt < 2:
            raise ValueError(f"attempt must be >= 2 (1 is the first call), got {attempt}")
        if not 0 <= u <= 1:
            raise ValueError(f"u must be in [0, 1], got {u}")
        backoff = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 2))
        delay = backoff * (1 + self.jitter * (2 * u - 1))
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(self.max_backoff_s, delay)

    def retries(self, error: TandemError, attempt: int) -> bool:
        """Whether attempt `attempt` failing with `error` is worth another attempt."""
        return attempt < self.max_attempts and error.code in self.codes

    def next_delay_s(
        self,
        attempt: int,
        error: TandemError,
        time_left_s: float | None,
        *,
        delivered: bool = False,
    ) -> float | None:
        """The wait before attempt `attempt + 1`, or None when `error` is to be raised.

        None when the failed attempt had `delivered` a chunk to the caller, when `retries`
        says no, or when the wait would not end before the `time_left_s` of the call's
        timeout (None: no timeout). The jitter is drawn from `rng` only for a retry that
        `retries` allows, one draw per such decision.

        Args:
            attempt: the attempt that failed (1: the first call).
            error: how it failed; its `retry_after_s` is the server's hint.
            time_left_s: what is left of the timeout over all attempts, or None.
            delivered: whether a chunk of the failed attempt reached the caller.
        """
        if delivered or not self.retries(error, attempt):
            return None
        delay = self.delay_s(attempt + 1, error.retry_after_s, self.rng())
        if time_left_s is not None and delay >= time_left_s:
            return None
        return delay


class Attempts:
    """The retry bookkeeping of one call: which attempt this is and the deadline over all of
    them, on `clock` (monotonic seconds). Each decision is `Retry.next_delay_s`'s."""

    def __init__(
        self,
        retry: Retry | None,
        timeout_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retry = retry
        self.clock = clock
        self.number = 1
        self.deadline = None if timeout_s is None else clock() + timeout_s

    def timeout_s(self) -> float | None:
        """This attempt's gRPC timeout: what is left of the call's (None: no timeout)."""
        return None if self.deadline is None else max(0.0, self.deadline - self.clock())

    def next_delay_s(self, error: TandemError, *, delivered: bool = False) -> float | None:
        """The wait before the next attempt, or None when `error` should be raised. A
        retry moves `number` on to the next attempt."""
        if self.retry is None:
            return None
        delay = self.retry.next_delay_s(self.number, error, self.timeout_s(), delivered=delivered)
        if delay is not None:
            self.number += 1
        return delay
