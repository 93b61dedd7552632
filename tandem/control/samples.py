"""What the controller observes: workers' heartbeat stats and finished requests' latencies,
gathered into an `Observation` for one decision."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.control.capacity import HostCapacity
from tandem.control.config import SLA
from tandem.load import Load


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSample(Load):
    """One worker's `Load` as its heartbeat gave it at time `t` (seconds, any monotonic
    origin). The fits read the rates: `busy_frac` (the fraction of the last stats period in
    steps), `tokens_per_s` (prefill: prompt tokens; decode: generated tokens plus prompt
    tokens it prefilled itself) and `step_ms` (0 when idle)."""

    t: float
    worker_id: str
    role: str
    draining: bool = False


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One finished request as the router timed it."""

    t: float
    ttft_ms: float
    itl_ms: float  # mean inter-token latency after the first token; 0 for 1-token outputs
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    disaggregated: bool = False

    @classmethod
    def of(
        cls,
        t: float,
        ttft_ms: float,
        total_ms: float,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
        disaggregated: bool = False,
    ) -> RequestSample:
        """A sample from a request's end-to-end timings: the mean inter-token latency is
        what came after the first token, spread over the tokens after it."""
        itl_ms = (total_ms - ttft_ms) / (output_tokens - 1) if output_tokens > 1 else 0.0
        return cls(t, ttft_ms, itl_ms, prompt_tokens, output_tokens, cached_tokens, disaggregated)


@dataclass(frozen=True, slots=True)
class Observation:
    """What the controller knows at time `now`: the replica counts it last asked for, and
    the samples of the window (older ones are the caller's to drop, see `SampleWindow`).

    Attributes:
        ready: workers per role up and serving, as the actuator sees them (Kubernetes:
            ready pods that heartbeat); None: the live workers of the latest samples. A
            worker still loading or warming up is not ready, and one asked for but not
            ready (starting, or a Pending pod) is not capacity yet.
        capacity: the most workers the host holds (the local actuator); None: no host
            limit (Kubernetes schedules pods onto nodes, and Pending ones are not ready).
        since: the samples reach back to here (the controller's start, or now - its
            window); None: as far back as the policy asks.
    """

    now: float
    replicas: dict[str, int]
    workers: Sequence[WorkerSample] = ()
    requests: Sequence[RequestSample] = ()
    sla: SLA = SLA()
    ready: Mapping[str, int] | None = None
    capacity: HostCapacity | None = None
    since: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
