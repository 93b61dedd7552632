"""The sliding window of timestamped samples a controller decides on. Pure: the caller
passes the time, so the controller service (wall clock) and the simulator (event time)
keep the same window.

  window_s = 4, prune(now=10) keeps (6, 10]:

    t:   5    6    7    8    9    10
         -    -    +    +    +    +       - dropped, + kept: the sample at t=6 is
              ^ now - window_s             exactly window_s old and leaves
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Generic, Protocol, TypeVar


class Timestamped(Protocol):
    @property
    def t(self) -> float: ...


S = TypeVar("S", bound=Timestamped)


@dataclass(slots=True)
class SampleWindow(Generic[S]):
    """The samples of the last `window_s` seconds, in the order they were added.

    After `prune(now)` it holds the samples with now - window_s < t, i.e. those less than
    `window_s` old. Half-open, (now - window_s, now], because samples come every P seconds
    (stats periods, heartbeat ticks): a window of k * P then holds exactly k of them, not
    k + 1 whenever a sample time lands on the boundary, which in the simulator (times that
    are exact multiples of P) would be every decision. Samples newer than `now` are kept.

    Raises:
        ValueError: window_s <= 0.
    """

    window_s: float
    _samples: deque[S] = field(default_factory=deque, init=False, repr=False)
    # Whether the samples are in time order, which makes pruning pop from the front only.
    # Requests timed by several routers can arrive slightly out of order.
    _in_order: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    def add(self, sample: S) -> None:
        if self._samples and sample.t < self._samples[-1].t:
            self._in_order = False
        self._samples.append(sample)

    def extend(self, samples: Iterable[S]) -> None:
        for sample in samples:
            self.add(sample)

    def prune(self, now: float) -> None:
        """Drop the samples `window_s` or more old at `now`."""
        # The horizon form (t <= now - window_s), not now - t >= window_s: the two can round
        # differently, and the simulator has always pruned with this one (same runs).
        horizon = now - self.window_s
        samples = self._samples
        if self._in_order:
            while samples and samples[0].t <= horizon:
                samples.popleft()
            return
        self._samples = deque(s for s in samples if s.t > horizon)
        self._in_order = all(a.t <= b.t for a, b in pairwise(self._samples))

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[S]:
        return iter(self._samples)
