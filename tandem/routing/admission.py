"""Admission by expected delay: refuse at once what could not start in time, instead of
accepting it and timing out. Pure: plain numbers in and out.

The worker that will compute a new request's prompt (the prefill worker, or the decode
worker for a colocated request) has tokens queued ahead of it. At that worker's measured
prefill rate, the new request's first token comes after about

    delay = (queued prompt tokens + the request's uncached tokens) / prefill tokens per s

The estimate is a mean, so admission plans to `PLAN_FRACTION` of `max_queue_delay_s`: the rate
wobbles (a long prompt's later chunks attend over more context than its first; the engine
loop's work between steps is not in the step time), and the limit is what a client is
promised. Past that the request is refused with RESOURCE_EXHAUSTED (HTTP 429) and a retry
hint of how long the queue needs to drain to it. (The overload soak, planning to the whole
limit, saw admitted first tokens up to 5% past it.) A worker that has not measured
a rate yet (just started, never busy) admits: nothing to estimate from, and its queue is
what a first measurement needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLAN_FRACTION = 0.9
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def queued_tokens(reported: int, inflight: int) -> int:
    """Prompt tokens ahead of a new request on a worker: what the worker last reported
    queued, or what this router sent it and has not seen answered, whichever is more (the
    two overlap: the router's own requests are in both)."""
    return max(reported, inflight)


def estimate_delay_s(queued: int, new_tokens: int, prefill_tokens_per_s: float) -> float | None:
    """Seconds until a new request's prompt is computed; None without a measured rate."""
    if prefill_tokens_per_s <= 0:
        return None
    return (max(queued, 0) + max(new_tokens, 0)) / prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    estimate_s: float | None  # the expected delay (None: no rate measured)
    retry_after_s: float = 0.0  # refused: when to try again
    reason: str = ""

    @staticmethod
    def decide(estimate_s: float | None, max_queue_delay_s: float, worker_id: str) -> Admission:
        """Admit unless the estimate exceeds PLAN_FRACTION of the limit (a limit of 0 turns
        the check off)."""
        plan = PLAN_FRACTION * max_queue_delay_s
        if max_queue_delay_s <= 0 or estimate_s is None or estimate_s <= plan:
            return Admission(True, estimate_s)
        wait = math.ceil(estimate_s - plan)
        retry = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait))
        return Admission(
            False,
            estimate_s,
            retry,
            f"expected queue delay {estimate_s:.1f}s on {worker_id} leaves too little of "
            f"max_queue_delay_s {max_queue_delay_s:g} (admits up to {plan:g}s); "
            f"retry in {retry:g}s",
        )
