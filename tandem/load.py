"""A worker's load: one record, produced by the worker and read by everything that places or
sizes work.

    engine.stats()            the counts, as the engine thread last published them
      + the worker's meter    busy_frac, tokens_per_s, step_ms, prefill_tokens_per_s
      = Load  ->  WorkerInfo (the registry record, tandem.services.common.redis.worker_info)
                  -> routing.WorkerLoad (placement: + this router's in-flight requests)
                  -> control.WorkerSample (the controller's fit: + the time it was read)
              ->  wpb.WorkerStats (GetStats; tandem.services.common.rpc.convert, once)

Each carrier *is* a `Load` plus its own fields (a subclass: its own fields keyword-only), so
a load figure is named and documented once and `load_fields` copies them all from one
carrier into the next. Validation belongs to the trust boundary: `check_load` runs where a
record arrives from outside (the registry's JSON), not on records the code builds itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The counts, which cannot be negative, and the rolling rates (numbers >= 0).
COUNT_FIELDS = (
    "num_running",
    "num_waiting",
    "queued_prefill_tokens",
    "num_blocks",
    "num_free_blocks",
    "num_handed_off",
    "num_preemptions",
    "host_tier_blocks",
    "disk_tier_blocks",
    "tier_hit_tokens",
)
RATE_FIELDS = (
    "busy_frac",
    "tokens_per_s",
    "step_ms",
    "prefill_tokens_per_s",
    "host_onload_tokens_per_s",
    "disk_onload_tokens_per_s",
)


@dataclass(frozen=True, slots=True)
class Load:
    """One worker's load.

    Counts, now: requests in the batch (`num_running`) and queued for it or for their KV
    (`num_waiting`); prompt tokens not yet prefilled (`queued_prefill_tokens`); KV blocks and
    free ones; requests whose KV is held for a decode worker to pull (`num_handed_off`,
    prefill); requests preempted since start (`num_preemptions`: one preempted twice counts
    twice).

    Rates over the last few seconds (the worker's meter; 0 from the engine alone): the
    fraction of time in steps (`busy_frac`), tokens computed per second (`tokens_per_s`),
    mean step time (`step_ms`), and the prompt tokens per second of step time it last
    measured, kept while idle (`prefill_tokens_per_s`: the router's admission estimate
    divides queued tokens by it, tandem.routing.admission).

    KV tiers (tandem.tiers), 0 where the worker has no such tier: the verified blocks its host
    and disk tiers hold now (`host_tier_blocks`, `disk_tier_blocks`) and the prompt tokens
    any tier has served since start (`tier_hit_tokens`: brought back and used), counts shown
    by `tandem ctl top`; and the prompt tokens per second its host and disk tiers bring back
    into the device cache, read and verified (`host_onload_tokens_per_s`,
    `disk_onload_tokens_per_s`), measured at start and kept current: placement weighs a tier
    hit against recomputing it (tandem.routing.tiers)."""

    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_handed_off: int = 0
    num_preemptions: int = 0
    host_tier_blocks: int = 0
    disk_tier_blocks: int = 0
    tier_hit_tokens: int = 0
    busy_frac: float = 0.0
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    host_onload_tokens_per_s: float = 0.0
    disk_onload_tokens_per_s: float = 0.0


LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(Load))


def load_fields(record: Load) -> dict[str, Any]:
    """`record`'s load figures (whatever carrier it is), as keywords for another carrier."""
    return {name: getattr(record, name) for name in LOAD_FIELDS}


def check_load(record: Load, what: str) -> None:
    """Raise ValueError naming `what` (e.g. "WorkerInfo") when a count is not an int >= 0 or
    a rate not a number >= 0 (a bool is neither: `True` blocks is a bug, not a count)."""
    for name in COUNT_FIELDS:
        value = getattr(record, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{what}.{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{what}.{name} must be >= 0, got {value}")
    for name in RATE_FIELDS:
        value = getattr(record, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{what}.{name} must be a number >= 0, got {value!r}")
