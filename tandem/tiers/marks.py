"""What a worker with KV tiers tells the prefix index about them (pure bookkeeping).

Per published key (`prefix_hash.table_key` of a block the index hears of) it tracks which of
device, host and disk hold it, and turns each change into the STORED / REMOVED events of
its `prefix_hash.tier_mark`s: the HOST mark while the device or the host holds the key, the
DISK mark while any tier does (the key itself is the device's, published by the block pool
as before). A router looking up the chain of a tier's marks learns how much of a prompt the
worker can bring back from that tier or above (tandem.routing.tiers).
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.engine.block_pool import KVEvent, KVEventKind
from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER, tier_mark

DEVICE = 0
# the tiers each mark stands for: HOST = device or host, DISK = any
_MARKS = ((HOST_TIER, (1 << DEVICE) | (1 << HOST_TIER)), (DISK_TIER, 0b111))


class TierMarks:
    def __init__(self) -> None:
        self._where: dict[int, int] = {}  # key -> bit per tier holding it

    def change(self, key: int, tier: int, held: bool) -> list[KVEvent]:
        """`tier` (DEVICE, HOST_TIER, DISK_TIER) now holds `key` or no longer does: the
        events of the marks that changed."""
        before = self._where.get(key, 0)
        after = before | (1 << tier) if held else before & ~(1 << tier)
        if after:
            self._where[key] = after
        else:
            self._where.pop(key, None)
        events = []
        for mark, tiers in _MARKS:
            if bool(before & tiers) != bool(after & tiers):
                kind = KVEventKind.STORED if after & tiers else KVEventKind.REMOVED
                events.append(KVEvent(kind, tier_mark(key, mark)))
        return events

    def hashes(self) -> list[int]:
        """Every mark held now (for a snapshot)."""
        return [
            tier_mark(key, mark)
            for key, where in self._where.items()
            for mark, tiers in _MARKS
            if where & tiers
        ]

    def reset(self, held: Iterable[tuple[int, int]]) -> None:
        """Start over from (key, tier) pairs held now."""
        self._where.clear()
        for key, tier in held:
            self._where[key] = self._where.get(key, 0) | (1 << tier)
