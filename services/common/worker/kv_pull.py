"""The outcome of one KV pull on a decode worker, as its metrics and traces describe it."""

from __future__ import annotations

from typing import NamedTuple

from tandem.types import KVOutcome


class Pulled(NamedTuple):
    """Outcome of a KV pull. committed: the request joined the batch with the pulled KV."""

    committed: bool
    num_cached_tokens: int  # prompt tokens this worker already held (not read)
    num_bytes: int
    transfer_ms: float
    failure: str = ""  # why not committed
    outcome: KVOutcome = KVOutcome.COMMITTED  # or LAPSED, FAILED
    num_tokens: int = 0  # token slots of the attention blocks read (whole blocks)
