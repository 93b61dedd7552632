"""Pool of KV blocks: reference counts, a prefix cache and LRU eviction.

A block is *used* while some request holds it (ref_cnt > 0) and *free* otherwise. A free
block may still hold a cached prefix (it keeps its hash) and can be revived by a cache hit
until allocation evicts it. Free blocks form one LRU queue:

    free queue:  front [never used, by id ... evicted first ... evicted last] back
    allocate() pops from the front; free() appends to the back.

The never-used blocks at the front are a counter, not entries: a block's record is made when
it is first handed out, so a pool costs what its used blocks cost, not its size (a tiny model
on a 141 GB GPU has 33 million blocks: building them all took 46 s of an H200 worker's start).

Callers free a request's blocks tail-first, so a prefix's later blocks are evicted before
its earlier ones (an earlier block is useful to more requests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    published: bool = True  # its hash is told to the prefix index (`cache_block`)


class KVEventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


class KVEvent(NamedTuple):
    """A change of the prefix cache, for the cluster-wide prefix index."""

    kind: KVEventKind
    block_hash: int


class BlockPool:
    """Fixed set of blocks with ids [0, num_blocks)."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_events: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        # Records of the blocks handed out so far: ids [0, len(blocks)); ids from there up
        # to num_blocks were never used and are the front of the free queue, in id order.
        self.blocks: list[Block] = []
        self._free: OrderedDict[int, None] = OrderedDict()  # freed blocks, after those
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []
        # Called with each cached block as its last holder frees it, and as `allocate` is
        # about to reuse it, while it holds its prefix's KV (the KV tiers copy it out:
        # tandem.engine.tiering).
        self.on_evict: Callable[[Block], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.blocks) + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (first evicted first)."""
        return [*range(len(self.blocks), self.num_blocks), *self._free]

    def cached_hashes(self) -> list[int]:
        """Every published prefix hash the pool can serve right now (used and free cached
        blocks)."""
        return [h for h, b in self._cached.items() if self.blocks[b].published]

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding the prefix `block_hash`, used or free, if any."""
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` fresh blocks (ref_cnt 1), evicting cached ones in LRU order.

        Returns None, changing nothing, if fewer blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            return None
        ids = []
        for _ in range(num_blocks):
            if len(self.blocks) < self.num_blocks:  # a never-used block comes first
                block = Block(len(self.blocks))
                self.blocks.append(block)
            else:
                block_id, _ = self._free.popitem(last=False)
                block = self.blocks[block_id]
                if block.block_hash is not None:
                    if self.on_evict is not None:
                        self.on_evict(block)
                    self._evict(block)
            block.ref_cnt = 1
            ids.append(block.block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); revives free blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order (first freed = first evicted)."""
        for block_id in block_ids:
            if not 0 <= block_id < len(self.blocks) or self.blocks[block_id].ref_cnt <= 0:
                raise ValueError(f"block {block_id} freed more times than it was taken")
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is not None and self.on_evict is not None:
                    self.on_evict(block)

    def cache_block(self, block_id: int, block_hash: int, publish: bool = True) -> bool:
        """Cache a full, computed block under its prefix hash; `publish`: its events go to
        the prefix index (a KV table the index is not told about caches it quietly).

        Returns False if caching is off or another block already holds that prefix (the
        duplicate stays private to its request and is not cached).
        """
        if not 0 <= block_id < len(self.blocks) or self.blocks[block_id].ref_cnt <= 0:
            raise ValueError(f"cannot cache free block {block_id}")
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.published = publish
        self._cached[block_hash] = block_id
        if self.record_events and publish:
            self._events.append(KVEvent(KVEventKind.STORED, block_hash))
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by a free block."""
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)

    def take_events(self) -> list[KVEvent]:
        """Events since the last call (only when created with record_events=True)."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.record_events and block.published:
            self._events.append(KVEvent(KVEventKind.REMOVED, block.block_hash))
        block.block_hash = None

    def check_integrity(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Assert the pool's invariants.

        Args:
            expected_refs: block id -> references held by the owner's block tables; every
                block not listed must have ref_cnt 0.
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free)
        assert all(0 <= i < len(self.blocks) for i in free_set), "a never-used block was freed"
        assert all(b.block_id == i for i, b in enumerate(self.blocks))
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_set), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"in free queue: {block.block_id in free_set}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, tables hold {want}"
                )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
        if expected_refs is not None:
            unused = [i for i in expected_refs if not 0 <= i < len(self.blocks)]
            assert not unused, f"tables hold blocks never handed out: {unused[:8]}"
        assert self.num_free_blocks + sum(b.ref_cnt > 0 for b in self.blocks) == self.num_blocks
