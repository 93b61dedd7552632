"""What a worker's KV tiers report: one record per tier, read by metrics and `tandem ctl top`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's figures since the worker started.

    Attributes:
        tier: "host" or "disk".
        capacity_bytes: the tier's budget (--kv-host-bytes, --kv-disk-bytes).
        used_bytes: bytes its verified blocks take now (records with their headers).
        blocks: verified blocks it holds now (each visible to lookups and the index).
        hit_tokens: prompt tokens served from this tier (brought back and used).
        offload_bytes / offload_seconds: block bytes written to the tier, and the tier
            thread's time writing them (sealing, digests, I/O).
        onload_bytes / onload_seconds: block bytes read back and verified, and the time it
            took (read and digest; the copy into the device cache is the engine's).
        skipped_offloads: evicted blocks the tier did not take because it was behind (its
            queue full): pushed back, never waited for.
        digest_mismatches: blocks whose bytes did not match their digest on read-back (or
            whose record was truncated or unreadable): each dropped and recomputed, never
            served.
        failed_writes: writes that failed (an I/O error, a full disk): never made visible.
        evictions: blocks the tier evicted to stay within its budget.
    """

    tier: str
    capacity_bytes: int
    used_bytes: int = 0
    blocks: int = 0
    hit_tokens: int = 0
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    onload_bytes: int = 0
    onload_seconds: float = 0.0
    skipped_offloads: int = 0
    digest_mismatches: int = 0
    failed_writes: int = 0
    evictions: int = 0
