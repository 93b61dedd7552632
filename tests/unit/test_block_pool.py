"""Block pool: exact block ids, eviction order, ref counts, randomized integrity."""

from __future__ import annotations

import random

import pytest

from tandem.engine.block_pool import BlockPool, KVEvent, KVEventKind


def test_allocate_takes_lowest_ids_first_and_none_when_short() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 3
    assert pool.allocate(4) is None
    assert pool.num_free_blocks == 3  # a failed allocation changes nothing
    pool.check_integrity({i: 1 for i in range(5)})


def test_a_huge_pool_costs_only_its_used_blocks() -> None:
    # A tiny model on a 141 GB GPU sizes its cache to ~33M blocks: a record per block built
    # up front took 46 s of a worker's start. Never-used blocks are a counter instead.
    pool = BlockPool(10**12)
    assert pool.num_free_blocks == 10**12 and pool.num_used_blocks == 0
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    # never-used blocks still come first, then the freed ones in LRU order
    assert pool.allocate(2) == [3, 4]
    assert len(pool.blocks) == 5 and pool.num_free_blocks == 10**12 - 4
    pool.check_integrity({0: 1, 2: 1, 3: 1, 4: 1})
    with pytest.raises(ValueError, match="freed more times"):
        pool.free([7])  # never handed out
    with pytest.raises(ValueError, match="cannot cache free block"):
        pool.cache_block(7, 123)


def test_freed_blocks_are_reused_last_in_lru_order() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3]
    pool.free([2, 0])  # 2 freed first -> evicted first
    assert pool.free_block_ids() == [2, 0]
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [0]
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_cached_free_block_is_revived_by_touch() -> None:
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    assert pool.cache_block(b, 111)
    pool.free([b])
    assert pool.get_cached_block(111) == 0
    pool.touch([0])
    assert pool.blocks[0].ref_cnt == 1
    assert 0 not in pool.free_block_ids()
    pool.check_integrity({0: 1})


def test_eviction_order_is_lru_and_forgets_hashes() -> None:
    pool = BlockPool(4, record_events=True)
    ids = pool.allocate(4)
    for i, h in zip(ids, (100, 101, 102, 103), strict=True):
        pool.cache_block(i, h)
    pool.free([3, 2])  # request A's tail-first free
    pool.free([1, 0])
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.allocate(2) == [3, 2]
    assert pool.get_cached_block(103) is None and pool.get_cached_block(102) is None
    assert pool.get_cached_block(101) == 1 and pool.get_cached_block(100) == 0
    events = pool.take_events()
    assert events == [KVEvent(KVEventKind.STORED, h) for h in (100, 101, 102, 103)] + [
        KVEvent(KVEventKind.REMOVED, 103),
        KVEvent(KVEventKind.REMOVED, 102),
    ]
    assert pool.take_events() == []
    pool.check_integrity({3: 1, 2: 1})


def test_shared_block_needs_every_reference_freed() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.touch([b])
    pool.free([b])
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="freed more times"):
        pool.free([b])


def test_duplicate_hash_is_not_cached_twice() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 5)
    assert not pool.cache_block(b, 5)
    assert pool.get_cached_block(5) == a
    assert pool.blocks[b].block_hash is None


def test_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    assert not pool.cache_block(a, 5)
    assert pool.get_cached_block(5) is None


def test_cannot_cache_a_free_block() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free block"):
        pool.cache_block(0, 1)


def test_reset_prefix_cache_keeps_used_blocks() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None
    assert pool.get_cached_block(2) == b


def test_check_integrity_catches_a_ref_mismatch() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity({})


def test_randomized_operations_keep_integrity() -> None:
    rng = random.Random(0)
    pool = BlockPool(16)
    held: list[list[int]] = []
    next_hash = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            ids = pool.allocate(rng.randint(1, 4))
            if ids is not None:
                held.append(ids)
        elif op < 0.6 and held:
            ids = rng.choice(held)
            for b in ids:
                if pool.blocks[b].block_hash is None:
                    pool.cache_block(b, next_hash)
                    next_hash += 1
        elif op < 0.8 and next_hash:
            # a cache hit on some hash, if still cached
            block_id = pool.get_cached_block(rng.randrange(next_hash))
            if block_id is not None:
                pool.touch([block_id])
                held.append([block_id])
        elif held:
            ids = held.pop(rng.randrange(len(held)))
            pool.free(reversed(ids))
        refs: dict[int, int] = {}
        for ids in held:
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        pool.check_integrity(refs)
    for ids in held:
        pool.free(ids)
    pool.check_integrity({})
    assert pool.num_free_blocks == 16
