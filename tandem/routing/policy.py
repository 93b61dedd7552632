"""Placement: which (prefill, decode) pair serves a request. Pure: plain data in, plain out.

Least-loaded for now: prefill cost ~ queued prefill tokens (reported by the worker plus what
this router sent since), decode cost ~ running + waiting requests. Conditional
disaggregation: a prompt whose uncached part is short is prefilled on the decode worker,
because shipping its KV would cost more than computing it there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Attributes:
    disagg_min_uncached_tokens: prompts with fewer uncached tokens skip the prefill worker.
    """

    disagg_min_uncached_tokens: int = 64

    def __post_init__(self) -> None:
        if self.disagg_min_uncached_tokens < 0:
            raise ValueError(
                f"disagg_min_uncached_tokens must be >= 0, got {self.disagg_min_uncached_tokens}"
            )


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the router knows about one worker when it places a request."""

    worker_id: str
    role: str  # "prefill" | "decode"
    address: str
    queued_prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    draining: bool = False
    inflight_requests: int = 0  # sent by this router, not yet finished
    inflight_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    decode: WorkerLoad
    prefill: WorkerLoad | None  # None: the decode worker prefills (colocated)
    reason: str

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


def _prefill_cost(w: WorkerLoad) -> tuple[int, str]:
    return (w.queued_prefill_tokens + w.inflight_prefill_tokens, w.worker_id)


def _decode_cost(w: WorkerLoad) -> tuple[int, int, str]:
    load = max(w.num_running + w.num_waiting, w.inflight_requests)
    return (load, -w.num_free_blocks, w.worker_id)


def choose(
    num_uncached_tokens: int, workers: Iterable[WorkerLoad], config: RoutingConfig
) -> Placement | None:
    """Pick the pair for a request with `num_uncached_tokens` to compute.

    Returns None when no decode worker is available (the caller answers UNAVAILABLE).
    Ties break on worker id, so equal loads place deterministically.
    """
    live = [w for w in workers if not w.draining]
    decodes = [w for w in live if w.role == "decode"]
    if not decodes:
        return None
    decode = min(decodes, key=_decode_cost)
    if num_uncached_tokens < config.disagg_min_uncached_tokens:
        return Placement(
            decode,
            None,
            f"{num_uncached_tokens} uncached tokens < "
            f"{config.disagg_min_uncached_tokens}: prefill on decode",
        )
    prefills = [w for w in live if w.role == "prefill"]
    if not prefills:
        return Placement(decode, None, "no prefill worker: prefill on decode")
    prefill = min(prefills, key=_prefill_cost)
    return Placement(decode, prefill, "least loaded pair")
