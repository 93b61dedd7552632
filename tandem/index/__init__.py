"""Cluster-wide prefix-cache index: block hash -> workers holding it, per model.

`PrefixIndex` is the contract (`tandem.index.base`), `MemoryPrefixIndex` the in-process
implementation; the Redis one lives in `tandem.services.common.redis.index` because it does I/O.
"""

from tandem.index.base import (
    MAX_WORKERS_PER_MODEL,
    ApplyResult,
    EventBatch,
    IndexFull,
    IndexUnavailable,
    PrefixIndex,
)
from tandem.index.memory import MemoryPrefixIndex

__all__ = [
    "MAX_WORKERS_PER_MODEL",
    "ApplyResult",
    "EventBatch",
    "IndexFull",
    "IndexUnavailable",
    "MemoryPrefixIndex",
    "PrefixIndex",
]
